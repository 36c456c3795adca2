//! This process's memory as Linux reports it, for the memory benchmarks.

/// `VmRSS` (resident now) and `VmHWM` (the resident peak) of this process, in MiB, from
/// `/proc/self/status`; NaN where that is not there (off Linux).
pub fn process_memory_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}
