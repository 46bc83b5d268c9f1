//! `pinned-bench info`: which CUDA is here, its devices, and the host facts that matter.

use std::fmt::Write as _;

use cuda_pinned::{Device, Error};

use crate::host;

/// The report as text; never fails (what cannot be read is said to be unknown).
pub fn report() -> String {
    let mut out = String::new();
    match cuda_pinned::runtime_path() {
        Ok(path) => {
            let version = cuda_pinned::runtime_version().map_or_else(
                |e| format!("version unknown: {e}"),
                |v| format!("runtime {v}"),
            );
            let _ = writeln!(out, "libcudart       {} ({version})", path.display());
            let driver = cuda_pinned::driver_version()
                .map_or_else(|e| format!("unknown: {e}"), |v| v.to_string());
            let _ = writeln!(out, "driver          supports CUDA {driver}");
            devices(&mut out);
        }
        Err(Error::Unavailable(load)) => {
            let _ = writeln!(
                out,
                "CUDA: not available, so the GPU parts cannot run here."
            );
            let _ = writeln!(out, "{load}");
        }
        Err(other) => {
            let _ = writeln!(out, "CUDA: not available: {other}");
        }
    }
    host_facts(&mut out);
    out
}

fn devices(out: &mut String) {
    let devices = match Device::all() {
        Ok(devices) if devices.is_empty() => {
            let _ = writeln!(
                out,
                "devices         none: the runtime loaded but found no GPU"
            );
            return;
        }
        Ok(devices) => devices,
        Err(e) => {
            let _ = writeln!(out, "devices         cannot be listed: {e}");
            return;
        }
    };
    for device in devices {
        let name = device
            .name()
            .unwrap_or_else(|e| format!("(name unknown: {e})"));
        let _ = writeln!(out, "device {}        {name}", device.ordinal());
        let Ok(bus_id) = device.pci_bus_id() else {
            continue;
        };
        let facts = host::pci_facts(&bus_id);
        let _ = writeln!(out, "  pci bus id    {bus_id}");
        let node = facts
            .numa_node
            .map_or("not reported".to_owned(), |n| n.to_string());
        let _ = writeln!(out, "  numa node     {node} (sysfs)");
        let link =
            |l: Option<(u32, u32)>| l.map_or("unknown".to_owned(), |(g, w)| format!("Gen{g} x{w}"));
        let _ = writeln!(
            out,
            "  pcie link     {} (max {})",
            link(facts.link),
            link(facts.max_link)
        );
        let yes_no = |r: cuda_pinned::Result<bool>| match r {
            Ok(true) => "yes".to_owned(),
            Ok(false) => "no".to_owned(),
            Err(e) => format!("unknown ({e})"),
        };
        let _ = writeln!(
            out,
            "  host register {}",
            yes_no(device.supports_host_registration())
        );
        let _ = writeln!(
            out,
            "  map host mem  {}",
            yes_no(device.can_map_host_memory())
        );
    }
}

fn host_facts(out: &mut String) {
    let memlock = match host::memlock_limit() {
        Ok(None) => "unlimited".to_owned(),
        Ok(Some(bytes)) => format!("{bytes} bytes (pinning more than this fails)"),
        Err(e) => format!("unknown: {e}"),
    };
    let _ = writeln!(out, "memlock limit   {memlock}");
    let thp = host::transparent_huge_pages().unwrap_or_else(|| "not available".to_owned());
    let _ = writeln!(out, "huge pages      transparent: {thp}");
    let _ = writeln!(out, "cpus            {}", host::cpus());
}
