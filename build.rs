//! Compiles the gRPC contract in `proto/` with protox (pure Rust), so no system protoc is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/hostdev/v1/hostdev.proto"];
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(files, ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("hostdev_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("hostdev_descriptor.bin"))
        .skip_protoc_run()
        // Decode errors are the caller's bad input: INVALID_ARGUMENT (src/api/codec.rs).
        .codec_path("crate::api::codec::HostDevCodec")
        .compile_fds(fds)?;
    Ok(())
}
