//! Links the cdylib as a drop-in `libnccl.so.2`: NCCL's soname, and a version script
//! that exports only `nccl*` / `pnccl*` symbols (with the `capi` feature, on by default).

fn main() {
    // Only with the C ABI: the Python extension links this crate without it and must
    // keep its own name and symbols.
    if std::env::var_os("CARGO_FEATURE_CAPI").is_none() {
        return;
    }
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=src/capi/libnccl.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/src/capi/libnccl.map");
}
