//! Compiles `proto/kvroute.proto` with a vendored `protoc`, so a fresh machine needs no system protobuf.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY-free: build scripts are single-threaded; prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc) };
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/kvroute.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/kvroute.proto");
    Ok(())
}
