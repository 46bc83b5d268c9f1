//! Facts about the host that decide what pinned memory costs: the memlock limit, transparent
//! huge pages, and each GPU's PCIe link and NUMA node as sysfs tells them.

use std::fs;
use std::path::PathBuf;

/// `RLIMIT_MEMLOCK` (soft limit) in bytes; `None` when unlimited.
pub fn memlock_limit() -> Result<Option<u64>, std::io::Error> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid out-pointer for getrlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur))
}

/// Whether this process may lock memory past `RLIMIT_MEMLOCK` (`CAP_IPC_LOCK` among its
/// effective capabilities, as for root).
pub fn has_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| effective_capabilities(&status))
        .is_some_and(|caps| caps >> CAP_IPC_LOCK & 1 == 1)
}

/// The `CapEff:` mask of a `/proc/PID/status` text.
fn effective_capabilities(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(line.trim(), 16).ok()
}

/// The selected transparent-huge-pages mode (`always`, `madvise` or `never`), if readable.
pub fn transparent_huge_pages() -> Option<String> {
    let text = fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    selected_mode(&text)
}

/// The bracketed word of a sysfs mode file: `always [madvise] never` → `madvise`.
fn selected_mode(text: &str) -> Option<String> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(text[start..end].to_owned())
}

/// What sysfs says about one PCI device.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PciFacts {
    /// NUMA node, when the platform reports one (`-1` in sysfs means none).
    pub numa_node: Option<u32>,
    /// Current link as `(generation, width)`.
    pub link: Option<(u32, u32)>,
    /// Maximum link as `(generation, width)`.
    pub max_link: Option<(u32, u32)>,
}

/// sysfs facts for a CUDA PCI bus id such as `00000000:17:00.0`.
pub fn pci_facts(bus_id: &str) -> PciFacts {
    let dir = PathBuf::from("/sys/bus/pci/devices").join(sysfs_address(bus_id));
    let read = |name: &str| {
        fs::read_to_string(dir.join(name))
            .ok()
            .map(|s| s.trim().to_owned())
    };
    let link = |speed: &str, width: &str| {
        Some((pcie_generation(&read(speed)?)?, read(width)?.parse().ok()?))
    };
    PciFacts {
        numa_node: read("numa_node")
            .and_then(|n| n.parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok()),
        link: link("current_link_speed", "current_link_width"),
        max_link: link("max_link_speed", "max_link_width"),
    }
}

/// CUDA writes the PCI domain with 4 or 8 hex digits; sysfs uses 4, lower case.
fn sysfs_address(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
            Ok(domain) => format!("{domain:04x}:{rest}"),
            Err(_) => lower,
        },
        None => lower,
    }
}

/// `32.0 GT/s PCIe` → 5.
fn pcie_generation(speed: &str) -> Option<u32> {
    let rate: f64 = speed.split_whitespace().next()?.parse().ok()?;
    let generations = [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
        (128.0, 7),
    ];
    generations
        .iter()
        .find(|(r, _)| (rate - r).abs() < 0.1)
        .map(|&(_, generation)| generation)
}

/// The machine's online NUMA nodes (`/sys/devices/system/node/online`, such as `0-1`); none
/// where the kernel does not say.
pub fn online_numa_nodes() -> Vec<u32> {
    std::fs::read_to_string("/sys/devices/system/node/online")
        .map(|list| parse_node_list(list.trim()))
        .unwrap_or_default()
}

/// `0-2,4` → `[0, 1, 2, 4]`; malformed parts are skipped.
fn parse_node_list(list: &str) -> Vec<u32> {
    list.split(',')
        .filter_map(|part| match part.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?..=b.parse().ok()?).collect::<Vec<u32>>()),
            None => part.parse().ok().map(|n| vec![n]),
        })
        .flatten()
        .collect()
}

/// Logical CPUs available to this process.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_node_lists() {
        assert_eq!(parse_node_list("0"), [0]);
        assert_eq!(parse_node_list("0-1"), [0, 1]);
        assert_eq!(parse_node_list("0-2,4"), [0, 1, 2, 4]);
        assert_eq!(parse_node_list("x,3"), [3]);
        assert!(parse_node_list("").is_empty());
    }

    #[test]
    fn reads_the_selected_mode() {
        assert_eq!(
            selected_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(selected_mode("no brackets"), None);
    }

    #[test]
    fn normalises_cuda_bus_ids_for_sysfs() {
        assert_eq!(sysfs_address("00000000:17:00.0"), "0000:17:00.0");
        assert_eq!(sysfs_address("0000:B3:00.0"), "0000:b3:00.0");
    }

    #[test]
    fn maps_link_speed_to_generation() {
        assert_eq!(pcie_generation("32.0 GT/s PCIe"), Some(5));
        assert_eq!(pcie_generation("8.0 GT/s PCIe"), Some(3));
        assert_eq!(pcie_generation("Unknown"), None);
    }

    #[test]
    fn memlock_limit_is_readable() {
        assert!(memlock_limit().is_ok());
    }

    #[test]
    fn effective_capabilities_parse() {
        let root = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(effective_capabilities(root), Some(0x1ff_ffff_ffff));
        assert_eq!(effective_capabilities("CapEff:\t0000000000000000"), Some(0));
        assert_eq!(effective_capabilities("Name: x"), None);
    }
}
