// NCCL's soname, so that programs linked against it record libnccl.so.2.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
}
