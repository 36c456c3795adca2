//! This process's memory and processor time as Linux reports them, for the benchmarks.

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

/// This process's processor time so far, user and system, from `/proc/self/stat` (clock ticks of
/// 1/100 s, Linux's `USER_HZ`); an error where that cannot be read (off Linux).
pub fn process_cpu_time() -> Result<std::time::Duration, Box<dyn std::error::Error>> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The fields after the command name (which may hold spaces), from the third on.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .ok_or("unreadable /proc/self/stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks = |i: usize| -> Result<u64, Box<dyn std::error::Error>> {
        Ok(fields.get(i).ok_or("short /proc/self/stat")?.parse()?)
    };
    // utime and stime are the 14th and 15th fields: the 12th and 13th after the name.
    Ok(std::time::Duration::from_millis(
        (ticks(11)? + ticks(12)?) * 10,
    ))
}
