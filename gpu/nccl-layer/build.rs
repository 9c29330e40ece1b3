// The layer's soname is the name it is installed and preloaded under.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libgpu-ckpt-nccl.so");
}
