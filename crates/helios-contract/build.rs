//! Compiles `proto/` with protox (pure Rust, so no `protoc` is needed anywhere) and prost.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = proto_root.join("flare/core/v1/runtime_core.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&proto_root])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
