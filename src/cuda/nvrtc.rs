//! Compiling `kernels/*.cu` at run time with NVRTC, for the device's own architecture.
//!
//! The sources are built into the library (`include_str!`), so a user needs no checkout
//! and no toolkit: only `libnvrtc.so.13`, which the `nvidia-cuda-nvrtc` wheel ships (torch
//! installs it) and which needs no GPU. cudarc finds it by its soname on the loader's
//! path; `FERROCCL_NVRTC` may name the library file (or its directory) instead, as a
//! Python virtualenv's `site-packages/nvidia/cu13/lib` is not on that path.
//!
//! Each source compiles to a cubin for `sm_XY` with `--fmad=false` (results must be bit
//! for bit those of the host kernels: no contraction of `a + b * s` into one rounding)
//! and ptxas's report (`--ptxas-options=-v`), kept with the image so that tests can
//! hold every kernel to a register budget and to zero spills. [`cubin`] caches images per
//! (source, architecture) for the life of the process.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

/// The header every kernel includes.
pub const HEADER: (&str, &str) = ("ferroccl.cuh", include_str!("../../kernels/ferroccl.cuh"));

/// One `kernels/*.cu` file and the entry points (`extern "C" __global__`) it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub name: &'static str,
    /// Its text.
    pub text: &'static str,
    /// Its entry points.
    pub entries: &'static [&'static str],
}

/// Element-wise reduce, pre-operation and post-operation over whole buffers.
pub const REDUCE: KernelSource = KernelSource {
    name: "reduce.cu",
    text: include_str!("../../kernels/reduce.cu"),
    entries: &["ferroccl_reduce", "ferroccl_pre", "ferroccl_post"],
};

/// The device executor of plans.
pub const EXECUTOR: KernelSource = KernelSource {
    name: "executor.cu",
    text: include_str!("../../kernels/executor.cu"),
    entries: &["ferroccl_execute"],
};

/// Every kernel source.
pub const KERNELS: [KernelSource; 2] = [REDUCE, EXECUTOR];

/// NVRTC symbols ferroccl calls (checked before the first call; see the module `cuda`).
const SYMBOLS: &[&str] = &[
    "nvrtcVersion",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcDestroyProgram",
    "nvrtcGetErrorString",
];

/// The loaded compiler: its version `(major, minor)`.
#[derive(Clone, Copy, Debug)]
pub struct Compiler {
    /// `nvrtcVersion`.
    pub version: (i32, i32),
}

/// NVRTC, or why it cannot be used.
pub fn compiler() -> Result<Compiler> {
    static COMPILER: OnceLock<std::result::Result<Compiler, String>> = OnceLock::new();
    COMPILER
        .get_or_init(load)
        .clone()
        .map_err(|what| Error::Cuda { what })
}

fn load() -> std::result::Result<Compiler, String> {
    if let Some(path) = std::env::var_os("FERROCCL_NVRTC") {
        let mut path = std::path::PathBuf::from(path);
        if path.is_dir() {
            path.push("libnvrtc.so.13");
        }
        // Loaded by path and kept loaded: cudarc's lookup by soname then finds it.
        // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => std::mem::forget(lib),
            Err(e) => return Err(format!("FERROCCL_NVRTC={}: {e}", path.display())),
        }
    }
    // SAFETY: probing dlopens candidates by name only.
    if !unsafe { sys::is_culib_present() } {
        return Err("NVRTC (libnvrtc.so.13) could not be loaded: install the \
                    nvidia-cuda-nvrtc wheel (pip) and set FERROCCL_NVRTC to its \
                    site-packages/nvidia/cu13/lib, or put the CUDA toolkit's lib64 on \
                    LD_LIBRARY_PATH"
            .into());
    }
    // SAFETY: the library is present (checked above); `get` only looks symbols up.
    let lib = unsafe { sys::culib() };
    if let Some(name) = super::missing_symbol(lib, SYMBOLS) {
        return Err(format!("NVRTC has no {name}: it is too old for ferroccl"));
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: every symbol is present; the call writes two ints.
    let rc = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {rc:?}"));
    }
    Ok(Compiler {
        version: (major, minor),
    })
}

/// A compiled kernel source.
#[derive(Clone, Debug)]
pub struct Cubin {
    /// The source's file name.
    pub source: &'static str,
    /// The architecture, `(major, minor)` as in `sm_XY`.
    pub arch: (u32, u32),
    /// The cubin image, for `cuModuleLoadData`.
    pub image: Vec<u8>,
    /// NVRTC's and ptxas's messages (ptxas's per-entry register and spill report).
    pub log: String,
}

/// What ptxas reported for one entry point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryReport {
    /// The entry point.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
}

impl Cubin {
    /// ptxas's report of each entry point (`Compiling entry function '…'` followed by
    /// its spill and register lines).
    pub fn entries(&self) -> Vec<EntryReport> {
        let mut out: Vec<EntryReport> = Vec::new();
        for line in self.log.lines() {
            if let Some(rest) = line.split("Compiling entry function '").nth(1) {
                let name = rest.split('\'').next().unwrap_or_default().to_string();
                out.push(EntryReport {
                    name,
                    registers: 0,
                    spill_stores: 0,
                    spill_loads: 0,
                });
                continue;
            }
            let Some(entry) = out.last_mut() else {
                continue;
            };
            let number_before = |what: &str| -> Option<u32> {
                let head = line.split(what).next()?;
                head.split_whitespace().last()?.parse().ok()
            };
            if line.contains("bytes spill stores") {
                entry.spill_stores = number_before(" bytes spill stores").unwrap_or(0);
                entry.spill_loads = number_before(" bytes spill loads").unwrap_or(0);
            }
            if line.contains(" registers") {
                entry.registers = line
                    .split("Used ")
                    .nth(1)
                    .and_then(|s| s.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
            }
        }
        out
    }
}

/// Compiles `source` for `sm_{major}{minor}` (no cache; see [`cubin`]).
pub fn compile(source: &KernelSource, arch: (u32, u32)) -> Result<Cubin> {
    compiler()?;
    let cuda = |what: String| Error::Cuda { what };
    let text = CString::new(source.text).map_err(|_| cuda("kernel source has a NUL".into()))?;
    let name = CString::new(source.name).map_err(|_| cuda("kernel name has a NUL".into()))?;
    let header = CString::new(HEADER.1).map_err(|_| cuda("header has a NUL".into()))?;
    let header_name = CString::new(HEADER.0).map_err(|_| cuda("header name has a NUL".into()))?;
    let options: Vec<CString> = [
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "--ptxas-options=-v".into(),
    ]
    .into_iter()
    .map(|o| CString::new(o).expect("options have no NUL"))
    .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut program: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: NVRTC is loaded with every symbol used here (checked by `compiler`). All
    // strings are NUL-terminated and outlive the calls; the program is destroyed on
    // every path after it is created.
    unsafe {
        nvrtc_check(
            sys::nvrtcCreateProgram(
                &mut program,
                text.as_ptr(),
                name.as_ptr(),
                1,
                &header.as_ptr(),
                &header_name.as_ptr(),
            ),
            "nvrtcCreateProgram",
        )?;
        let compiled =
            sys::nvrtcCompileProgram(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
        let log = program_log(program);
        let result = match nvrtc_check(compiled, "nvrtcCompileProgram") {
            Err(e) => Err(cuda(format!(
                "{} for sm_{}{}: {e}\n{log}",
                source.name, arch.0, arch.1
            ))),
            Ok(()) => get_cubin(program).map(|image| Cubin {
                source: source.name,
                arch,
                image,
                log,
            }),
        };
        sys::nvrtcDestroyProgram(&mut program);
        result
    }
}

/// The cubin of `source` for `arch`, compiled once per process.
pub fn cubin(source: &KernelSource, arch: (u32, u32)) -> Result<Arc<Cubin>> {
    type Cache = Mutex<HashMap<(&'static str, (u32, u32)), Arc<Cubin>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(c) = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(source.name, arch))
    {
        return Ok(c.clone());
    }
    let compiled = Arc::new(compile(source, arch)?);
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert((source.name, arch), compiled.clone());
    Ok(compiled)
}

/// # Safety
/// NVRTC is loaded with `nvrtcGetErrorString`.
unsafe fn nvrtc_check(rc: sys::nvrtcResult, call: &str) -> Result<()> {
    if rc == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: returns a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(rc)) };
    Err(Error::Cuda {
        what: format!("{call} failed: {}", text.to_string_lossy()),
    })
}

/// # Safety
/// `program` is a live NVRTC program.
unsafe fn program_log(program: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: a live program; the calls write the size, then that many bytes.
    unsafe {
        if sys::nvrtcGetProgramLogSize(program, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        let mut buf = vec![0u8; size.max(1)];
        if sys::nvrtcGetProgramLog(program, buf.as_mut_ptr() as *mut c_char)
            != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .to_string()
    }
}

/// # Safety
/// `program` is a live, compiled NVRTC program.
unsafe fn get_cubin(program: sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    // SAFETY: a live compiled program; the calls write the size, then that many bytes.
    unsafe {
        nvrtc_check(
            sys::nvrtcGetCUBINSize(program, &mut size),
            "nvrtcGetCUBINSize",
        )?;
        let mut image = vec![0u8; size];
        nvrtc_check(
            sys::nvrtcGetCUBIN(program, image.as_mut_ptr() as *mut c_char),
            "nvrtcGetCUBIN",
        )?;
        Ok(image)
    }
}
