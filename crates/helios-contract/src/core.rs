//! Opening a runtime core directory: manifest, kernel images, payloads, frontend assets.
//!
//! Layout of a core directory:
//! ```text
//! manifest.pb          binary RuntimeCore message
//! payloads/*.safetensors
//! kernels/*.cubin
//! frontend/tokenizer.json, frontend/chat_template.jinja
//! ```
//! [`RuntimeCore::open`] validates all of it before anyone touches a device. Payload bytes stay
//! in the page cache through read-only memory maps; weights are never copied onto the heap.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use prost::Message;
use sha2::{Digest, Sha256};

use crate::error::{CoreError, FieldPath};
use crate::model::{BufferId, DType, KernelId, Manifest, Payload};
use crate::pb;
use crate::validate::validate;

/// File name of the manifest inside a core directory.
pub const MANIFEST_FILE: &str = "manifest.pb";

/// Options for [`RuntimeCore::open_with`].
#[derive(Clone, Copy, Debug)]
pub struct OpenOptions {
    /// Hash every payload file against its recorded sha256. Kernel images and frontend assets
    /// are always hashed (they are small). Disable only for cores on trusted local storage
    /// where startup time matters more than detecting corruption.
    pub verify_payload_digests: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions { verify_payload_digests: true }
    }
}

/// A validated, opened runtime core. Holds the kernel images and the payload maps.
#[derive(Debug)]
pub struct RuntimeCore {
    root: PathBuf,
    manifest: Manifest,
    /// Parallel to `manifest.kernels`.
    kernel_images: Vec<Vec<u8>>,
    /// Parallel to `manifest.payload_files`.
    payload_maps: Vec<Mmap>,
    /// Parallel to `manifest.buffers`: `(file_index, byte range)` of each safetensors payload.
    payload_ranges: Vec<Option<(usize, std::ops::Range<usize>)>>,
}

impl RuntimeCore {
    /// Opens and validates the core at `root` with default options.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, CoreError> {
        Self::open_with(root, OpenOptions::default())
    }

    pub fn open_with(root: impl AsRef<Path>, options: OpenOptions) -> Result<Self, CoreError> {
        let root = root.as_ref().to_path_buf();
        let manifest_bytes = read_file(&root.join(MANIFEST_FILE))?;
        let raw = pb::RuntimeCore::decode(manifest_bytes.as_slice())?;
        let manifest = validate(&raw)?;

        let kernels_path = FieldPath::root("core").field("kernels");
        let mut kernel_images = Vec::with_capacity(manifest.kernels.len());
        for k in &manifest.kernels {
            let field = kernels_path.keyed("id", k.id.0);
            let bytes = read_file(&root.join(&k.file))?;
            check_digest(&bytes, &k.sha256, &k.file, &field.field("sha256"))?;
            kernel_images.push(bytes);
        }

        let files_path = FieldPath::root("core").field("payload_files");
        let mut payload_maps = Vec::with_capacity(manifest.payload_files.len());
        for (i, f) in manifest.payload_files.iter().enumerate() {
            let field = files_path.index(i);
            let path = root.join(&f.path);
            let file = File::open(&path).map_err(|source| CoreError::Io { path: path.clone(), source })?;
            // SAFETY: the map is read-only and private to this process; the core directory is
            // treated as immutable while loaded (documented in the README).
            let map = unsafe { Mmap::map(&file) }.map_err(|source| CoreError::Io { path: path.clone(), source })?;
            if map.len() as u64 != f.byte_size {
                return Err(CoreError::FileSize {
                    field: field.field("byte_size"),
                    path: f.path.clone(),
                    expected: f.byte_size,
                    actual: map.len() as u64,
                });
            }
            if options.verify_payload_digests {
                check_digest(&map, &f.sha256, &f.path, &field.field("sha256"))?;
            }
            payload_maps.push(map);
        }

        let headers = manifest
            .payload_files
            .iter()
            .zip(&payload_maps)
            .enumerate()
            .map(|(i, (f, map))| {
                safetensors::SafeTensors::read_metadata(map).map_err(|source| CoreError::Safetensors {
                    field: files_path.index(i),
                    path: f.path.clone(),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;

        let buffers_path = FieldPath::root("core").field("buffers");
        let mut payload_ranges = Vec::with_capacity(manifest.buffers.len());
        for b in &manifest.buffers {
            let Payload::Safetensors { file_index, tensor } = &b.payload else {
                payload_ranges.push(None);
                continue;
            };
            let field = buffers_path.keyed("id", b.id.0).field("safetensors").field("tensor");
            let (header_len, metadata) = &headers[*file_index];
            let path = &manifest.payload_files[*file_index].path;
            let info = metadata.info(tensor).ok_or_else(|| CoreError::MissingTensor {
                field: field.clone(),
                path: path.clone(),
                tensor: tensor.clone(),
            })?;
            let mismatch =
                |reason: String| CoreError::TensorMismatch { field: field.clone(), tensor: tensor.clone(), reason };
            let tensor_dtype = from_safetensors_dtype(info.dtype);
            let compatible =
                tensor_dtype == Some(b.dtype) || (b.dtype == DType::Bytes && tensor_dtype == Some(DType::U8));
            if !compatible {
                return Err(mismatch(format!("dtype {:?}, buffer is {}", info.dtype, b.dtype.name())));
            }
            let (start, end) = info.data_offsets;
            if (end - start) as u64 != b.byte_size {
                return Err(mismatch(format!("{} bytes, buffer is {}", end - start, b.byte_size)));
            }
            let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
            if !b.shape.is_empty() && shape != b.shape {
                return Err(mismatch(format!("shape {shape:?}, buffer is {:?}", b.shape)));
            }
            let data_start = 8 + header_len;
            payload_ranges.push(Some((*file_index, data_start + start..data_start + end)));
        }

        let fe_path = FieldPath::root("core").field("frontend");
        for (asset, name) in
            [(&manifest.frontend.tokenizer, "tokenizer"), (&manifest.frontend.chat_template, "chat_template")]
        {
            let bytes = read_file(&root.join(&asset.path))?;
            check_digest(&bytes, &asset.sha256, &asset.path, &fe_path.field(name).field("sha256"))?;
        }

        Ok(RuntimeCore { root, manifest, kernel_images, payload_maps, payload_ranges })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The exact image bytes of a kernel.
    pub fn kernel_image(&self, id: KernelId) -> Option<&[u8]> {
        let i = self.manifest.kernels.binary_search_by_key(&id, |k| k.id).ok()?;
        Some(&self.kernel_images[i])
    }

    /// A buffer's initial bytes when its payload is a safetensors tensor (borrowed from the map).
    pub fn payload(&self, id: BufferId) -> Option<&[u8]> {
        let i = self.manifest.buffers.binary_search_by_key(&id, |b| b.id).ok()?;
        let (file, range) = self.payload_ranges[i].as_ref()?;
        Some(&self.payload_maps[*file][range.clone()])
    }

    /// Absolute path of a frontend asset or other core-relative file.
    pub fn asset_path(&self, relative: &str) -> PathBuf {
        self.root.join(relative)
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, CoreError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|source| CoreError::Io { path: path.to_path_buf(), source })?;
    Ok(bytes)
}

/// Lower-case hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn check_digest(bytes: &[u8], expected: &str, path: &str, field: &FieldPath) -> Result<(), CoreError> {
    let actual = sha256_hex(bytes);
    if actual == expected {
        Ok(())
    } else {
        Err(CoreError::DigestMismatch {
            field: field.clone(),
            path: path.to_owned(),
            expected: expected.to_owned(),
            actual,
        })
    }
}

fn from_safetensors_dtype(d: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::BOOL => DType::Bool,
        S::U8 => DType::U8,
        S::I8 => DType::I8,
        S::I16 => DType::I16,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::I32 => DType::I32,
        S::U32 => DType::U32,
        S::F32 => DType::F32,
        S::F64 => DType::F64,
        S::I64 => DType::I64,
        S::U64 => DType::U64,
        S::F8_E4M3 => DType::F8E4M3,
        S::F8_E5M2 => DType::F8E5M2,
        _ => return None,
    })
}

/// Safetensors dtype name for a buffer dtype (used by writers of cores).
pub fn to_safetensors_dtype(d: DType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        DType::Bool => S::BOOL,
        DType::U8 | DType::Bytes => S::U8,
        DType::I8 => S::I8,
        DType::I16 => S::I16,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::I32 => S::I32,
        DType::U32 => S::U32,
        DType::F32 => S::F32,
        DType::F64 => S::F64,
        DType::I64 => S::I64,
        DType::U64 => S::U64,
        DType::F8E4M3 => S::F8_E4M3,
        DType::F8E5M2 => S::F8_E5M2,
    }
}
