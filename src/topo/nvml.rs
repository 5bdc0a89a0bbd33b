//! GPUs and their NVLink peers through NVML, loaded at run time (`libnvidia-ml.so.1`),
//! so ferroccl builds and runs where no NVIDIA driver is installed.
//!
//! Only the handful of NVML calls topology needs are used: the device count, each
//! device's name and PCI bus id, and for each NVLink whether it is active and the PCI
//! bus id at its far end (another GPU, or an NVSwitch).

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::pci::normalise_bus_id;

/// NVML's `nvmlPciInfo_t` (identical in the `_v2` and `_v3` calls).
#[repr(C)]
struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

impl PciInfo {
    fn zeroed() -> Self {
        PciInfo {
            bus_id_legacy: [0; 16],
            domain: 0,
            bus: 0,
            device: 0,
            pci_device_id: 0,
            pci_sub_system_id: 0,
            bus_id: [0; 32],
        }
    }

    fn bus_id(&self) -> String {
        let bytes: Vec<u8> = self
            .bus_id
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        normalise_bus_id(&String::from_utf8_lossy(&bytes))
    }
}

type Device = *mut c_void;
const SUCCESS: c_int = 0;
/// Most NVLinks a GPU has (`NVML_NVLINK_MAX_LINKS`).
const MAX_LINKS: c_uint = 18;

/// One GPU as NVML reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmlGpu {
    /// NVML's index.
    pub index: usize,
    /// Product name.
    pub name: String,
    /// PCI bus id in sysfs form.
    pub bus_id: String,
    /// For each active NVLink, the PCI bus id at its far end.
    pub nvlinks: Vec<String>,
}

/// The GPUs NVML sees, or why there are none to see (no library, no driver, an NVML
/// error): the reason is shown by `ferroccl-topo` and in the topology dump.
pub fn gpus() -> Result<Vec<NvmlGpu>, String> {
    // SAFETY: loading NVML runs its initialisers, which have no preconditions.
    let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }
        .map_err(|e| format!("NVML not loadable: {e}"))?;
    // SAFETY: every symbol is looked up with NVML's documented C signature.
    unsafe {
        let init: libloading::Symbol<unsafe extern "C" fn() -> c_int> =
            lib.get(b"nvmlInit_v2\0")
                .map_err(|e| format!("NVML: {e}"))?;
        let count: libloading::Symbol<unsafe extern "C" fn(*mut c_uint) -> c_int> = lib
            .get(b"nvmlDeviceGetCount_v2\0")
            .map_err(|e| format!("NVML: {e}"))?;
        let handle: libloading::Symbol<unsafe extern "C" fn(c_uint, *mut Device) -> c_int> = lib
            .get(b"nvmlDeviceGetHandleByIndex_v2\0")
            .map_err(|e| format!("NVML: {e}"))?;
        let name: libloading::Symbol<unsafe extern "C" fn(Device, *mut c_char, c_uint) -> c_int> =
            lib.get(b"nvmlDeviceGetName\0")
                .map_err(|e| format!("NVML: {e}"))?;
        let pci: libloading::Symbol<unsafe extern "C" fn(Device, *mut PciInfo) -> c_int> = lib
            .get(b"nvmlDeviceGetPciInfo_v3\0")
            .or_else(|_| lib.get(b"nvmlDeviceGetPciInfo_v2\0"))
            .map_err(|e| format!("NVML: {e}"))?;
        let link_state: Option<
            libloading::Symbol<unsafe extern "C" fn(Device, c_uint, *mut c_int) -> c_int>,
        > = lib.get(b"nvmlDeviceGetNvLinkState\0").ok();
        let link_remote: Option<
            libloading::Symbol<unsafe extern "C" fn(Device, c_uint, *mut PciInfo) -> c_int>,
        > = lib.get(b"nvmlDeviceGetNvLinkRemotePciInfo_v2\0").ok();
        let shutdown: Option<libloading::Symbol<unsafe extern "C" fn() -> c_int>> =
            lib.get(b"nvmlShutdown\0").ok();

        let rc = init();
        if rc != SUCCESS {
            return Err(format!("nvmlInit failed with NVML error {rc}"));
        }
        let mut n: c_uint = 0;
        let rc = count(&mut n);
        let mut out = Vec::new();
        if rc == SUCCESS {
            for index in 0..n {
                let mut dev: Device = std::ptr::null_mut();
                if handle(index, &mut dev) != SUCCESS {
                    continue;
                }
                let mut buf = [0 as c_char; 96];
                let product = if name(dev, buf.as_mut_ptr(), buf.len() as c_uint) == SUCCESS {
                    std::ffi::CStr::from_ptr(buf.as_ptr())
                        .to_string_lossy()
                        .into_owned()
                } else {
                    String::new()
                };
                let mut info = PciInfo::zeroed();
                let bus_id = if pci(dev, &mut info) == SUCCESS {
                    info.bus_id()
                } else {
                    String::new()
                };
                let mut nvlinks = Vec::new();
                if let (Some(state), Some(remote)) = (&link_state, &link_remote) {
                    for link in 0..MAX_LINKS {
                        let mut active: c_int = 0;
                        if state(dev, link, &mut active) != SUCCESS || active == 0 {
                            continue;
                        }
                        let mut far = PciInfo::zeroed();
                        if remote(dev, link, &mut far) == SUCCESS {
                            nvlinks.push(far.bus_id());
                        }
                    }
                }
                out.push(NvmlGpu {
                    index: index as usize,
                    name: product,
                    bus_id,
                    nvlinks,
                });
            }
        }
        if let Some(shutdown) = shutdown {
            shutdown();
        }
        if rc != SUCCESS {
            return Err(format!("nvmlDeviceGetCount failed with NVML error {rc}"));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_info_has_nvmls_layout() {
        // 16 + 5 × 4 + 32 bytes, no padding: the size NVML writes.
        assert_eq!(std::mem::size_of::<PciInfo>(), 68);
    }

    #[test]
    fn gpus_or_a_reason() {
        match gpus() {
            Ok(gpus) => {
                for g in gpus {
                    assert!(super::super::pci::is_pci_addr(&g.bus_id), "{g:?}");
                }
            }
            Err(why) => assert!(why.contains("NVML"), "{why}"),
        }
    }
}
