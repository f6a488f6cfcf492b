//! Tells the tests which of the kernels' CPU features the build machine has, so a test of a
//! kernel this CPU cannot run is reported as ignored (with the reason), never as passed.
//! `dart_cpu_avx2`: AVX2 and FMA; `dart_cpu_avx512`: AVX-512F/BW/VL; `dart_cpu_avx512bf16`:
//! AVX512-BF16 as well; `dart_cpu_amx`: AMX-BF16
//! and AMX-TILE as well (the OS permission for tile data is asked at run time: a test that
//! finds it refused fails).
//! Only for native builds (host = target); a cross build marks neither.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(dart_cpu_avx2)");
    println!("cargo::rustc-check-cfg=cfg(dart_cpu_avx512)");
    println!("cargo::rustc-check-cfg=cfg(dart_cpu_amx)");
    println!("cargo::rustc-check-cfg=cfg(dart_cpu_avx512bf16)");
    println!("cargo::rerun-if-changed=build.rs");
    let native = std::env::var("HOST").ok() == std::env::var("TARGET").ok();
    if native && avx2() {
        println!("cargo::rustc-cfg=dart_cpu_avx2");
    }
    if native && avx512() {
        println!("cargo::rustc-cfg=dart_cpu_avx512");
        if avx512_bf16() {
            println!("cargo::rustc-cfg=dart_cpu_avx512bf16");
        }
        if amx() {
            println!("cargo::rustc-cfg=dart_cpu_amx");
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_bf16() -> bool {
    std::arch::is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_bf16() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn amx() -> bool {
    // CPUID leaf 7, subleaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    #[allow(unused_unsafe)] // __cpuid is safe on newer toolchains
    let (max_leaf, edx) = unsafe {
        let max_leaf = std::arch::x86_64::__cpuid(0).eax;
        let edx = if max_leaf >= 7 {
            std::arch::x86_64::__cpuid_count(7, 0).edx
        } else {
            0
        };
        (max_leaf, edx)
    };
    max_leaf >= 7 && edx & (1 << 22) != 0 && edx & (1 << 24) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn amx() -> bool {
    false
}
