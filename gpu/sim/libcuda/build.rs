// The real driver's soname, so that programs linked against it record libcuda.so.1.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
