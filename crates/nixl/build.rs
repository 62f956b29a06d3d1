//! Builds the stride shim (`shim/stride.cc`) with feature `nixl`. The shim links against no
//! NIXL library (it finds NIXL's symbols at run time), so it needs only a C++ compiler; without
//! one the crate still builds, with cfg `kvbridge_nixl_no_shim`, and the transport posts
//! per-row descriptors and says why.

fn main() {
    println!("cargo:rerun-if-changed=shim/stride.cc");
    println!("cargo::rustc-check-cfg=cfg(kvbridge_nixl_no_shim)");
    build_shim();
}

#[cfg(feature = "nixl")]
fn build_shim() {
    let built = cc::Build::new()
        .cpp(true)
        .std("c++17")
        .flag_if_supported("-fvisibility=hidden")
        .warnings(true)
        .file("shim/stride.cc")
        .try_compile("kvbridge_nixl_stride");
    match built {
        Ok(()) => println!("cargo:rustc-link-lib=dylib=dl"),
        Err(e) => {
            println!(
                "cargo:warning=kvbridge-nixl: the stride shim was not built ({e}); NIXL stride \
                 descriptors are off and strided ops go to NIXL as one descriptor per row"
            );
            println!("cargo:rustc-cfg=kvbridge_nixl_no_shim");
        }
    }
}

#[cfg(not(feature = "nixl"))]
fn build_shim() {}
