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
    // The messages and the client.
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("hostdev_descriptor.bin"))
        .skip_protoc_run()
        .build_server(false)
        .codec_path("crate::api::codec::HostDevCodec")
        .compile_fds(fds.clone())?;
    // The server alone, on the messages above, except that a Watch stream carries events
    // already encoded (src/api/wire.rs): one change goes to every watcher, and is built
    // and encoded once for all of them. The bytes on the wire are a `WatchEvent`'s.
    let server = out.join("server");
    std::fs::create_dir_all(&server)?;
    tonic_prost_build::configure()
        .out_dir(&server)
        .skip_protoc_run()
        .build_client(false)
        .extern_path(".hostdev.v1", "crate::api::proto")
        .extern_path(".hostdev.v1.WatchEvent", "crate::api::wire::WireEvent")
        // Decode errors are the caller's bad input: INVALID_ARGUMENT (src/api/codec.rs).
        .codec_path("crate::api::codec::HostDevCodec")
        .compile_fds(fds)?;
    Ok(())
}
