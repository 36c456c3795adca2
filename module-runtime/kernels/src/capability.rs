//! Which instruction sets the CPU kernels run, chosen at run time for the CPU at hand.
//!
//! One binary serves every x86-64 host: each kernel is compiled for several instruction sets
//! (AVX-512, AVX2 + FMA, the baseline) and each entry picks one per call, from what the CPU has and
//! from what was measured to be fastest on it. PyTorch names these levels its *CPU capability*
//! (`torch.backends.cpu.get_cpu_capability()`: `"DEFAULT"`, `"AVX2"`, `"AVX512"`) and lets the
//! environment variable `ATEN_CPU_CAPABILITY` lower it; here the same names and the same variable
//! do the same, and [`with_cpu_capability`] does it for one thread (and the pool work it starts).
//!
//! # What each operation takes
//!
//! [`kernel_choice`] says it, operation by operation. Without a setting every operation takes the
//! widest instruction set the CPU has and the operation is built for, with one measured
//! exception: the float32 products take AVX2 on a CPU whose AVX-512 units are 256 bits wide
//! (AMD's Zen 4, family 19h), where `gemm`'s AVX-512 kernels ran slower than its AVX2 ones
//! (BENCHMARKS.md, "Kernels chosen by the host"); on Intel's Xeons, two 512-bit units, they ran
//! up to twice as fast. Setting a capability (the variable or [`with_cpu_capability`]) forces it
//! everywhere, that exception included, down to what each operation is built for and the CPU has:
//! that is how the tests run every implementation on one host.
//!
//! # Bfloat16 products
//!
//! A product of bfloat16 operands (a bfloat16 model's, or one under `autocast` to bfloat16) takes
//! this crate's AVX512-BF16 kernel (`vdpbf16ps`: pairs of bfloat16 products summed into float32,
//! `bf16_gemm.rs`) where the CPU has AVX512-BF16 and the level allowed is `AVX512`
//! ([`KernelChoice::bf16_products`]); elsewhere the float32 kernels multiply the operands' values
//! and round the result once (the same numbers up to the order of the sums). Intel's AMX tiles
//! (Sapphire Rapids on) multiply bfloat16 several times faster still, but no AMX kernel is
//! written yet: the development host (AMD Zen 5) has AVX512-BF16 and no AMX, so tile code could
//! not be run or tested there. An AMX host has AVX512-BF16 too and takes that kernel.
//!
//! The choice never changes within a process unless a setting changes it, so a run repeats to the
//! bit. Implementations differ in rounding only (the products and the quantized sums add in
//! another order); the elementwise passes give the same bits under every choice.

use std::cell::Cell;
use std::fmt;
use std::sync::OnceLock;

/// An instruction-set level a kernel can be compiled for, from the narrowest, with PyTorch's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuCapability {
    /// x86-64's baseline (SSE2), or any other architecture: portable loops the compiler vectorizes.
    Default,
    /// AVX2 with FMA and F16C (x86-64-v3): 8 float32 lanes.
    Avx2,
    /// AVX-512 F, BW and VL on top of AVX2 (x86-64-v4): 16 float32 lanes.
    Avx512,
}

impl CpuCapability {
    /// PyTorch's name: `"DEFAULT"`, `"AVX2"` or `"AVX512"`.
    pub fn name(self) -> &'static str {
        match self {
            CpuCapability::Default => "DEFAULT",
            CpuCapability::Avx2 => "AVX2",
            CpuCapability::Avx512 => "AVX512",
        }
    }

    /// The level a name gives, in any case (`"avx2"`, `"AVX512"`, `"default"`), as
    /// `ATEN_CPU_CAPABILITY` takes it.
    ///
    /// ```
    /// use module_runtime::backends::cpu::CpuCapability;
    /// assert_eq!(CpuCapability::from_name("avx2"), Some(CpuCapability::Avx2));
    /// assert_eq!(CpuCapability::from_name("sse9"), None);
    /// ```
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Default, Self::Avx2, Self::Avx512]
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(name.trim()))
    }
}

impl fmt::Display for CpuCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the kernels know of the CPU and the environment, read once.
struct Host {
    /// What [`detect`] read off the CPU.
    cpu: Detected,
    /// `ATEN_CPU_CAPABILITY`, where set to a level's name.
    env: Option<CpuCapability>,
    /// `ATEN_CPU_CAPABILITY`'s value where it names no level (then ignored, and reported).
    env_ignored: Option<String>,
}

fn host() -> &'static Host {
    static HOST: OnceLock<Host> = OnceLock::new();
    HOST.get_or_init(|| {
        let (env, env_ignored) = match std::env::var("ATEN_CPU_CAPABILITY") {
            Ok(value) => match CpuCapability::from_name(&value) {
                Some(level) => (Some(level), None),
                None => (None, Some(value)),
            },
            Err(_) => (None, None),
        };
        Host {
            cpu: detect(),
            env,
            env_ignored,
        }
    })
}

/// What [`detect`] reads off the CPU.
struct Detected {
    /// The CPU's own name (its brand string), or `"unknown CPU"`.
    name: String,
    /// The widest level the CPU has.
    best: CpuCapability,
    /// Whether it has AVX-512 VNNI (the quantized kernel's AVX-512 loops need it).
    vnni: bool,
    /// Whether it has AVX512-BF16 (`vdpbf16ps`; the bfloat16 products' kernel needs it).
    bf16: bool,
    /// Whether its AVX-512 instructions run at full width (not split in two 256-bit halves).
    full_width_512: bool,
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Detected {
    use std::arch::is_x86_feature_detected as has;
    use std::arch::x86_64::__cpuid;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
    let best = match (avx512, avx2) {
        (true, _) => CpuCapability::Avx512,
        (false, true) => CpuCapability::Avx2,
        _ => CpuCapability::Default,
    };
    // Leaf 0: the vendor (EBX, EDX, ECX); leaf 1: the family (EAX bits 8–11, plus 20–27 when
    // those read 15); leaves 0x8000_0002–4: the brand string.
    let leaf0 = __cpuid(0);
    let vendor: Vec<u8> = [leaf0.ebx, leaf0.edx, leaf0.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    let eax = __cpuid(1).eax;
    let base_family = (eax >> 8) & 0xF;
    let family = match base_family {
        0xF => base_family + ((eax >> 20) & 0xFF),
        _ => base_family,
    };
    let name = match __cpuid(0x8000_0000).eax >= 0x8000_0004 {
        true => {
            let bytes: Vec<u8> = (0x8000_0002..=0x8000_0004u32)
                .flat_map(|leaf| {
                    let r = __cpuid(leaf);
                    [r.eax, r.ebx, r.ecx, r.edx]
                })
                .flat_map(|r| r.to_le_bytes())
                .collect();
            String::from_utf8_lossy(&bytes)
                .trim_matches(|c: char| c == '\0' || c.is_whitespace())
                .to_string()
        }
        false => String::new(),
    };
    Detected {
        name: if name.is_empty() {
            "unknown CPU".to_string()
        } else {
            name
        },
        best,
        vnni: avx512 && has!("avx512vnni"),
        bf16: avx512 && has!("avx512bf16"),
        // AMD's family 19h (Zen 3, Zen 4) runs AVX-512 as two 256-bit halves; Zen 5 (1Ah) and
        // Intel's AVX-512 cores run it whole.
        full_width_512: !(vendor == b"AuthenticAMD" && family == 0x19),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Detected {
    Detected {
        name: "unknown CPU".to_string(),
        best: CpuCapability::Default,
        vnni: false,
        bf16: false,
        full_width_512: false,
    }
}

thread_local! {
    /// This thread's [`with_cpu_capability`], if one is running.
    static FORCED: Cell<Option<CpuCapability>> = const { Cell::new(None) };
}

/// The level set for the calling thread: [`with_cpu_capability`]'s, else `ATEN_CPU_CAPABILITY`'s.
fn forced() -> Option<CpuCapability> {
    FORCED.with(Cell::get).or(host().env)
}

/// The widest instruction set the kernels may use on the calling thread: the CPU's, lowered by
/// `ATEN_CPU_CAPABILITY` or a running [`with_cpu_capability`], as PyTorch's
/// `torch.backends.cpu.get_cpu_capability()`.
///
/// ```
/// use module_runtime::backends::cpu::{get_cpu_capability, with_cpu_capability, CpuCapability};
/// let widest = get_cpu_capability();
/// with_cpu_capability(CpuCapability::Default, || {
///     assert_eq!(get_cpu_capability(), CpuCapability::Default);
/// });
/// assert_eq!(get_cpu_capability(), widest);
/// ```
pub fn get_cpu_capability() -> CpuCapability {
    level_of(forced())
}

/// The level the kernels may use where `forced` is the calling thread's setting: the CPU's, or
/// `forced` where that is lower.
fn level_of(forced: Option<CpuCapability>) -> CpuCapability {
    let best = host().cpu.best;
    forced.map_or(best, |level| level.min(best))
}

/// Runs `f` with every kernel started on this thread (and the pool work those start) built for
/// `capability`, or for the widest level below it that the CPU has and the operation is built
/// for; the measured exceptions of automatic choice do not apply. The previous setting comes back
/// when `f` returns or unwinds, so calls nest. For comparing implementations and reproducing a
/// result from another host; `ATEN_CPU_CAPABILITY` does the same for a whole process.
pub fn with_cpu_capability<R>(capability: CpuCapability, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<CpuCapability>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FORCED.with(|cell| cell.set(self.0));
        }
    }
    let _restore = Restore(FORCED.with(|cell| cell.replace(Some(capability))));
    f()
}

/// The instruction set each operation's kernel takes on the calling thread, and the CPU it runs
/// on: what [`kernel_choice`] returns. Its `Display` is one line, for a log or a benchmark's
/// header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelChoice {
    /// The CPU's name (its brand string).
    pub cpu: &'static str,
    /// The widest level the CPU has.
    pub cpu_capability: CpuCapability,
    /// Float32 products (`linear`, the training ops' products).
    pub products: CpuCapability,
    /// Whether bfloat16 products (`linear` on bfloat16 operands, and under `autocast` to
    /// bfloat16) take this crate's AVX512-BF16 kernel: where the CPU has AVX512-BF16 and the
    /// level allowed is `AVX512`. Otherwise the float32 kernels (`products`) multiply the
    /// operands' values and the result is rounded once.
    pub bf16_products: bool,
    /// The `q8_0`/`q4_0`/`q4_K` kernel (`AVX512` means AVX-512 VNNI).
    pub quantized: CpuCapability,
    /// The elementwise passes (GELU, SiLU and the other activations in place).
    pub elementwise: CpuCapability,
    /// Attention's kernels, forward and backward (built for AVX2 at most).
    pub attention: CpuCapability,
    /// The optimizers' fused step (built for AVX2 at most).
    pub optimizer: CpuCapability,
}

/// The kernels the calling thread's operations take now (see the module's documentation).
///
/// ```
/// use module_runtime::backends::cpu::{kernel_choice, with_cpu_capability, CpuCapability};
/// let auto = kernel_choice();
/// println!("{auto}"); // e.g. "AMD EPYC (AVX512): products AVX2, bf16 products AVX512_BF16, ..."
/// let forced = with_cpu_capability(CpuCapability::Avx2, kernel_choice);
/// assert!(forced.products <= CpuCapability::Avx2 && forced.quantized <= CpuCapability::Avx2);
/// assert!(!forced.bf16_products); // bfloat16 products on the float32 kernels
/// ```
pub fn kernel_choice() -> KernelChoice {
    let host = host();
    let forced = forced();
    let level = level_of(forced);
    let forced = forced.is_some();
    let avx2_at_most = level.min(CpuCapability::Avx2);
    KernelChoice {
        cpu: &host.cpu.name,
        cpu_capability: host.cpu.best,
        products: match level {
            CpuCapability::Avx512 if !forced && !host.cpu.full_width_512 => CpuCapability::Avx2,
            level => level,
        },
        bf16_products: level == CpuCapability::Avx512 && host.cpu.bf16,
        quantized: match level {
            CpuCapability::Avx512 if !host.cpu.vnni => CpuCapability::Avx2,
            level => level,
        },
        elementwise: level,
        attention: avx2_at_most,
        optimizer: avx2_at_most,
    }
}

impl fmt::Display for KernelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): products {}, bf16 products {}, quantized {}, elementwise {}, attention {}, \
             optimizer {}",
            self.cpu,
            self.cpu_capability,
            self.products,
            match self.bf16_products {
                true => "AVX512_BF16",
                false => "via float32",
            },
            self.quantized,
            self.elementwise,
            self.attention,
            self.optimizer
        )?;
        match (&host().env, &host().env_ignored) {
            (Some(level), _) => write!(f, " (ATEN_CPU_CAPABILITY={level})"),
            (None, Some(value)) => write!(
                f,
                " (ATEN_CPU_CAPABILITY={value:?} ignored: not DEFAULT, AVX2 or AVX512)"
            ),
            (None, None) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_level_is_lowered_to_what_the_cpu_has_and_restored_after_a_panic() {
        let auto = kernel_choice();
        let forced = with_cpu_capability(CpuCapability::Avx512, kernel_choice);
        assert_eq!(forced.products, auto.cpu_capability);
        assert!(forced.attention <= CpuCapability::Avx2);
        // The bfloat16 kernel is an AVX-512 one: below, the float32 kernels.
        assert_eq!(forced.bf16_products, auto.bf16_products);
        assert!(!with_cpu_capability(CpuCapability::Avx2, kernel_choice).bf16_products);
        let caught = std::panic::catch_unwind(|| {
            with_cpu_capability(CpuCapability::Default, || {
                assert_eq!(kernel_choice().products, CpuCapability::Default);
                panic!("unwinds through the setting");
            })
        });
        assert!(caught.is_err());
        assert_eq!(kernel_choice(), auto);
    }

    #[test]
    fn names_read_back() {
        for level in [
            CpuCapability::Default,
            CpuCapability::Avx2,
            CpuCapability::Avx512,
        ] {
            assert_eq!(CpuCapability::from_name(level.name()), Some(level));
        }
        assert!(CpuCapability::Default < CpuCapability::Avx2);
    }
}
