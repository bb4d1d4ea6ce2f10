//! What this CPU runs of the packed kernels, detected once: the AVX-512 float kernels (the
//! matrix–vector products, the widening of blocks, a prompt's panels) and the integer ones
//! (AVX-512 VNNI). Both are `false` where the crate is built without its `avx512` feature or
//! for another architecture.

/// AVX-512 F and BW with F16C and FMA: what the float kernels use.
pub fn avx512() -> bool {
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("f16c")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(all(target_arch = "x86_64", feature = "avx512")))]
    {
        false
    }
}

/// [`avx512`] and AVX-512 VNNI: what the integer products use.
pub fn vnni() -> bool {
    #[cfg(all(target_arch = "x86_64", feature = "avx512"))]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| avx512() && std::arch::is_x86_feature_detected!("avx512vnni"))
    }
    #[cfg(not(all(target_arch = "x86_64", feature = "avx512")))]
    {
        false
    }
}
