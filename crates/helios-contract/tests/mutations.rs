//! Mutation properties: a corrupted manifest or payload never panics the loader, and every
//! rejection of a decodable manifest names the offending field.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use helios_contract::fixtures::{Fixture, FixtureSpec};
use helios_contract::{CoreError, MANIFEST_FILE, RuntimeCore, pb, validate};
use proptest::prelude::*;
use prost::Message;

fn assert_named(err: &CoreError) {
    match err {
        CoreError::Io { .. } | CoreError::Decode(_) => {}
        other => {
            let field = other.field().expect("manifest errors name a field");
            assert!(field.as_str().starts_with("core"), "{field}");
            assert!(!other.to_string().is_empty());
        }
    }
}

/// Sets one manifest field, chosen by `which`, to a value derived from `v`.
fn mutate(m: &mut pb::RuntimeCore, which: usize, v: u64) {
    let n_graphs = m.graphs.len().max(1);
    let g = (v as usize) % n_graphs;
    let b = (v as usize) % m.buffers.len().max(1);
    let small = (v % 7) as u32;
    match which % 32 {
        0 => m.identity.as_mut().unwrap().abi_version = small,
        1 => m.arena.as_mut().unwrap().base_address = v,
        2 => m.arena.as_mut().unwrap().alignment = v % 4096,
        3 => m.buffers[b].offset = v % (1 << 20),
        4 => m.buffers[b].byte_size = v % (1 << 20),
        5 => m.buffers[b].alignment = v % 1024,
        6 => m.buffers[b].role = (v % 14) as i32,
        7 => m.buffers[b].dtype = (v % 18) as i32,
        8 => m.buffers[b].shape.push(v % 5),
        9 => m.buffers[b].payload = None,
        10 => m.payload_files[0].byte_size = v,
        11 => m.kernels[(v % 2) as usize].params.push(pb::ParamSlot { offset: small, size: small }),
        12 => m.graphs[g].kind = (v % 9) as i32,
        13 => m.graphs[g].maintenance_op = (v % 7) as i32,
        14 => m.graphs[g].capacity.as_mut().unwrap().request_count = small,
        15 => m.graphs[g].capacity.as_mut().unwrap().token_capacity = small,
        16 => m.graphs[g].edges.push(pb::Edge {
            from: 10 + small,
            to: 10 + (v as u32 % 5),
            // Full, programmatic, launch order, or unknown.
            dependency: (v % 4) as i32,
        }),
        17 => {
            if let Some(pb::node::Op::Kernel(k)) = m.graphs[g].nodes[0].op.as_mut() {
                let i = (v as usize) % k.relocations.len().max(1);
                if let Some(r) = k.relocations.get_mut(i) {
                    r.buffer_offset = v % (1 << 16);
                }
            }
        }
        18 => {
            if let Some(pb::node::Op::Kernel(k)) = m.graphs[g].nodes[0].op.as_mut() {
                let len = k.param_bytes.len();
                k.param_bytes.truncate((v as usize) % (len + 1));
            }
        }
        19 => {
            if let Some(pb::node::Op::Kernel(k)) = m.graphs[g].nodes[0].op.as_mut()
                && let Some(r) = k.relocations.first_mut()
            {
                r.param_index = small;
                r.byte_offset = (v % 16) as u32;
            }
        }
        20 => {
            let bindings = &mut m.graphs[g].bindings;
            let i = (v as usize) % bindings.len().max(1);
            if let Some(binding) = bindings.get_mut(i) {
                binding.shape = vec![v % 9];
            }
        }
        21 => {
            let bindings = &mut m.graphs[g].bindings;
            let i = (v as usize) % bindings.len().max(1);
            if let Some(binding) = bindings.get_mut(i) {
                binding.view.as_mut().unwrap().offset = v % 8192;
            }
        }
        22 => {
            let bindings = &mut m.graphs[g].bindings;
            if let Some(binding) = bindings.first_mut() {
                binding.value = (v % 30) as i32;
                binding.direction = (v % 3) as i32;
            }
        }
        23 => m.cache_scheme.as_mut().unwrap().page_tokens = small,
        24 => m.cache_scheme.as_mut().unwrap().continuation_row_bytes = v % 4096,
        25 => m.cache_scheme.as_mut().unwrap().verification_width = small,
        26 => m.capacities.as_mut().unwrap().decode_request_buckets.push(small),
        27 => m.capacities.as_mut().unwrap().max_kv_pages = small,
        28 => m.capacities.as_mut().unwrap().vocab_size = small,
        29 => {
            let s = m.frontend.as_mut().unwrap().sampling.as_mut().unwrap();
            s.top_k.as_mut().unwrap().default = v as f64 / 3.0 - 1000.0;
        }
        30 => m.frontend.as_mut().unwrap().eos_token_ids.push(v as u32),
        _ => m.graphs[g].nodes.push(pb::Node { id: 10 + small, op: None }),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Structural mutations of a decoded manifest: validation returns Ok or a named error.
    #[test]
    fn field_mutations_are_named(abi in 1u32..5, edits in prop::collection::vec((0usize..32, any::<u64>()), 1..4)) {
        let spec = match abi {
            1 => FixtureSpec::abi1(),
            2 => FixtureSpec::abi2(),
            3 => FixtureSpec { abi: 3, ..FixtureSpec::speculative() },
            _ => FixtureSpec::speculative(),
        };
        let mut f = Fixture::build(&spec);
        for (which, v) in edits {
            mutate(&mut f.manifest, which, v);
        }
        if let Err(err) = validate(&f.manifest) {
            assert_named(&err);
        }
    }

    /// Byte-level corruption of the encoded manifest: decoding and validation never panic.
    #[test]
    fn manifest_byte_corruption_never_panics(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let f = Fixture::build(&FixtureSpec::default());
        let mut bytes = f.manifest.encode_to_vec();
        for (at, mask) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(raw) = pb::RuntimeCore::decode(bytes.as_slice())
            && let Err(err) = validate(&raw)
        {
            assert_named(&err);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Altering or truncating any file a core names is always detected, and names the field.
    #[test]
    fn file_corruption_is_detected(file in 0usize..5, at in any::<prop::sample::Index>(), mask in 1u8.., truncate in any::<bool>()) {
        let mut f = Fixture::build(&FixtureSpec::default());
        let (_, bytes) = &mut f.files[file];
        if truncate {
            let len = at.index(bytes.len());
            bytes.truncate(len);
        } else {
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
        }
        let dir = tempfile::tempdir().unwrap();
        f.write_to(dir.path()).unwrap();
        let err = RuntimeCore::open(dir.path()).expect_err("corruption must be detected");
        assert_named(&err);
        prop_assert!(err.field().is_some(), "{err}");
    }
}

#[test]
fn missing_manifest_is_io() {
    let dir = tempfile::tempdir().unwrap();
    let err = RuntimeCore::open(dir.path()).unwrap_err();
    assert!(matches!(err, CoreError::Io { ref path, .. } if path.ends_with(MANIFEST_FILE)));
}
