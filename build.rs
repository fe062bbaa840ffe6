fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("rcp_descriptor.bin"))
        .compile_protos(&["proto/rcp/v1/rcp.proto"], &["proto"])?;
    Ok(())
}
