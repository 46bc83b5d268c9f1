//! `pinned-bench info`: which CUDA is here, its devices, and the host facts that matter.

use cuda_pinned::{Device, Error};

use crate::host;

/// Whose calls queue copies and handle events: the driver's own (cheaper), or the runtime's.
fn calls() -> String {
    let asked = std::env::var_os(cuda_pinned::RUNTIME_CALLS_VAR).is_some_and(|v| !v.is_empty());
    if asked {
        return format!("the runtime's ({} is set)", cuda_pinned::RUNTIME_CALLS_VAR);
    }
    match cuda_pinned::sys::driver::driver() {
        Ok(driver) => {
            let missing: Vec<_> = driver
                .unresolved()
                .into_iter()
                .filter(|name| {
                    ["cuMemcpy", "cuEvent", "cuPointer"]
                        .iter()
                        .any(|p| name.starts_with(p))
                })
                .collect();
            if missing.is_empty() {
                "the driver's own".into()
            } else {
                format!(
                    "the runtime's where the driver lacks them: {}",
                    missing.join(", ")
                )
            }
        }
        Err(e) => format!("the runtime's: {e}", e = cuda_pinned::ErrorChain(&e)),
    }
}

/// The facts as (key, value) pairs; never fails (what cannot be read says so).
pub fn facts() -> Vec<(String, String)> {
    let mut facts = Vec::new();
    let mut fact = |k: &str, v: String| facts.push((k.to_owned(), v));
    cuda_facts(&mut fact);
    host_facts(&mut fact);
    facts
}

/// The CUDA runtime, driver and devices, or why there are none.
fn cuda_facts(fact: &mut impl FnMut(&str, String)) {
    match cuda_pinned::runtime_path() {
        Ok(path) => {
            let version = cuda_pinned::runtime_version().map_or_else(
                |e| format!("version unknown: {e}", e = cuda_pinned::ErrorChain(&e)),
                |v| format!("runtime {v}"),
            );
            fact("libcudart", format!("{} ({version})", path.display()));
            let driver = cuda_pinned::driver_version().map_or_else(
                |e| format!("unknown: {e}", e = cuda_pinned::ErrorChain(&e)),
                |v| v.to_string(),
            );
            fact("driver", format!("supports CUDA {driver}"));
            fact("copy and event calls", calls());
            match Device::all() {
                Ok(devices) if devices.is_empty() => fact(
                    "devices",
                    "none: the runtime loaded but found no GPU".into(),
                ),
                Ok(devices) => {
                    for device in devices {
                        device_facts(device, fact);
                    }
                }
                Err(e) => fact(
                    "devices",
                    format!("cannot be listed: {e}", e = cuda_pinned::ErrorChain(&e)),
                ),
            }
        }
        Err(Error::Unavailable(load)) => {
            fact(
                "cuda",
                "not available, so the GPU parts cannot run here".into(),
            );
            fact("search", load.to_string());
        }
        Err(other) => fact("cuda", format!("not available: {other}")),
    }
}

/// The host's facts, read with or without CUDA: memlock, huge pages, cpus, NUMA nodes.
fn host_facts(fact: &mut impl FnMut(&str, String)) {
    let memlock = match host::memlock_limit() {
        Ok(None) => "unlimited".to_owned(),
        Ok(Some(bytes)) if host::has_ipc_lock() => {
            format!("{bytes} bytes, not enforced here: this process holds CAP_IPC_LOCK")
        }
        Ok(Some(bytes)) => {
            format!("{bytes} bytes: locking more with mlock (the kind used without CUDA) fails")
        }
        Err(e) => format!("unknown: {e}", e = cuda_pinned::ErrorChain(&e)),
    };
    fact("memlock limit", memlock);
    fact(
        "huge pages",
        format!(
            "transparent: {}",
            host::transparent_huge_pages().unwrap_or_else(|| "not available".into())
        ),
    );
    fact("cpus", host::cpus().to_string());
    let nodes = host::online_numa_nodes();
    fact(
        "numa nodes",
        if nodes.is_empty() {
            "unknown".into()
        } else {
            nodes
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        },
    );
    fact(
        "pinned memory goes to",
        "registered and virtual (cuMemCreate): the current device's node; cudaHostAlloc: \
         the node of the thread that first touches it (the kernel's default policy)"
            .into(),
    );
}

fn device_facts(device: Device, fact: &mut impl FnMut(&str, String)) {
    let n = device.ordinal();
    fact(
        &format!("device {n}"),
        device
            .name()
            .unwrap_or_else(|e| format!("(name unknown: {e})", e = cuda_pinned::ErrorChain(&e))),
    );
    let Ok(bus_id) = device.pci_bus_id() else {
        return;
    };
    let facts = host::pci_facts(&bus_id);
    fact(&format!("device {n} pci bus id"), bus_id);
    fact(
        &format!("device {n} numa node"),
        format!(
            "{}, {}",
            device
                .host_numa_node()
                .map_or("not reported (CUDA)".into(), |n| format!("{n} (CUDA)")),
            facts
                .numa_node
                .map_or("not reported (sysfs)".into(), |n| format!("{n} (sysfs)"))
        ),
    );
    let link =
        |l: Option<(u32, u32)>| l.map_or("unknown".to_owned(), |(g, w)| format!("Gen{g} x{w}"));
    fact(
        &format!("device {n} pcie link"),
        format!("{} (max {})", link(facts.link), link(facts.max_link)),
    );
    let yes_no = |r: cuda_pinned::Result<bool>| match r {
        Ok(true) => "yes".to_owned(),
        Ok(false) => "no".to_owned(),
        Err(e) => format!("unknown ({e})", e = cuda_pinned::ErrorChain(&e)),
    };
    fact(
        &format!("device {n} host register"),
        yes_no(device.supports_host_registration()),
    );
    fact(
        &format!("device {n} map host mem"),
        yes_no(device.can_map_host_memory()),
    );
    fact(
        &format!("device {n} virtual host mem"),
        yes_no(device.supports_virtual_host_memory()),
    );
}

/// The facts as aligned text.
pub fn render(facts: &[(String, String)]) -> String {
    let width = facts.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    facts
        .iter()
        .map(|(k, v)| format!("{k:<width$}  {v}\n"))
        .collect()
}
