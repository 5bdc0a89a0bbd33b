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
//! hold every kernel to a register budget and to zero spills.
//!
//! Compiling `executor.cu` takes NVRTC over a minute on a small machine, inside a rank's
//! first device call while its peers wait. [`cubin`] therefore keeps each image on disk
//! as well as in memory: under `FERROCCL_CACHE_DIR` (default `$XDG_CACHE_HOME/ferroccl`,
//! else `~/.cache/ferroccl`), named by the source's and header's hash, the architecture
//! and NVRTC's version, written atomically (a temporary file renamed into place) under a
//! lock file, so that concurrent ranks compile once and a second process or run loads the
//! image in milliseconds. A cache that cannot be written is only slower.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::sys;
use sha2::{Digest, Sha256};

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
    if let Some(path) = std::env::var_os("FERROCCL_NVRTC").filter(|p| !p.is_empty()) {
        let mut path = std::path::PathBuf::from(path);
        if path.is_dir() {
            // NVRTC 13 (the wheel torch installs), else 12, else an unversioned name.
            let dir = path.clone();
            path = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
                .iter()
                .map(|name| dir.join(name))
                .find(|p| p.exists())
                .unwrap_or_else(|| dir.join("libnvrtc.so.13"));
        }
        // Loaded by path and kept loaded: cudarc's lookup by soname then finds it.
        // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => std::mem::forget(lib),
            Err(e) => return Err(format!("FERROCCL_NVRTC={}: {e}", path.display())),
        }
        preload_builtins(path.parent())?;
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

/// Loads NVRTC's builtins library (`libnvrtc-builtins.so.M.m`) from the directory NVRTC
/// was loaded from. NVRTC opens it by soname when it compiles; NVRTC 13.2 finds it beside
/// itself (its RUNPATH is `$ORIGIN`), but NVRTC 13.0 (the wheel torch 2.11 installs) has
/// no RUNPATH and fails every compile with "failed to open libnvrtc-builtins.so.13.0"
/// unless the directory is on `LD_LIBRARY_PATH`. A library already loaded answers a
/// later open by its soname, so loading it here serves both.
fn preload_builtins(dir: Option<&std::path::Path>) -> std::result::Result<(), String> {
    let Some(entries) = dir.and_then(|d| std::fs::read_dir(d).ok()) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // `libnvrtc-builtins.alt.so.*` is the variant for NVRTC's alternative build.
        if name.starts_with("libnvrtc-builtins.so.") {
            // SAFETY: loading NVRTC's builtins runs its initialisers, which have no
            // preconditions.
            match unsafe { libloading::Library::new(entry.path()) } {
                Ok(lib) => std::mem::forget(lib),
                Err(e) => return Err(format!("{}: {e}", entry.path().display())),
            }
        }
    }
    Ok(())
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

/// NVRTC's options for `arch`.
fn options(arch: (u32, u32)) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{}{}", arch.0, arch.1),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "--ptxas-options=-v".into(),
    ]
}

/// Refuses NVRTC whose cubins the driver cannot load: a cubin from NVRTC of CUDA major
/// version M needs a driver that supports CUDA M (minor versions of one major are
/// compatible). `driver` is `cuDriverGetVersion`'s number (e.g. 12080).
pub fn check_driver_supports(compiler: (i32, i32), driver: i32) -> Result<()> {
    let (major, minor) = (driver / 1000, driver % 1000 / 10);
    if major >= compiler.0 {
        return Ok(());
    }
    Err(Error::Cuda {
        what: format!(
            "NVRTC {}.{} makes cubins that need a driver for CUDA {}, but the CUDA driver \
             supports CUDA {major}.{minor} (cuDriverGetVersion {driver}): update the NVIDIA \
             driver, or point FERROCCL_NVRTC at NVRTC {major}.x",
            compiler.0, compiler.1, compiler.0
        ),
    })
}

/// Compiles `source` for `sm_{major}{minor}` (no cache; see [`cubin`]).
pub fn compile(source: &KernelSource, arch: (u32, u32)) -> Result<Cubin> {
    compiler()?;
    let cuda = |what: String| Error::Cuda { what };
    let text = CString::new(source.text).map_err(|_| cuda("kernel source has a NUL".into()))?;
    let name = CString::new(source.name).map_err(|_| cuda("kernel name has a NUL".into()))?;
    let header = CString::new(HEADER.1).map_err(|_| cuda("header has a NUL".into()))?;
    let header_name = CString::new(HEADER.0).map_err(|_| cuda("header name has a NUL".into()))?;
    let options: Vec<CString> = options(arch)
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

/// The cubin of `source` for `arch`: from this process's memory, else from the disk
/// cache ([`cache_dir`]), else compiled (and then kept in both).
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
    let compiled = Arc::new(cubin_cached_in(cache_dir().as_deref(), source, arch)?);
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert((source.name, arch), compiled.clone());
    Ok(compiled)
}

/// The directory of the cubin cache: `FERROCCL_CACHE_DIR`, else `$XDG_CACHE_HOME/ferroccl`,
/// else `$HOME/.cache/ferroccl`; `None` when none is set.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    var("FERROCCL_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("ferroccl")))
        .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".cache/ferroccl")))
}

/// The file name of `source`'s cubin for `arch` from NVRTC `version`: the hash covers
/// the source, the header it includes and the compile options.
pub fn cache_name(source: &KernelSource, arch: (u32, u32), version: (i32, i32)) -> String {
    let mut hash = Sha256::new();
    for part in [source.name, source.text, HEADER.1] {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part.as_bytes());
    }
    for option in options(arch) {
        hash.update(option.as_bytes());
    }
    let digest: String = hash.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let stem = source.name.trim_end_matches(".cu");
    format!(
        "{stem}-sm_{}{}-nvrtc{}.{}-{digest}.cubin",
        arch.0, arch.1, version.0, version.1
    )
}

/// The cubin of `source` for `arch` through the disk cache in `dir` (`None`: no cache):
/// read from it, else compiled and written to it (atomically, under a lock, so that
/// concurrent processes compile once). A cache that cannot be used costs a compile, never
/// an error.
pub fn cubin_cached_in(
    dir: Option<&Path>,
    source: &KernelSource,
    arch: (u32, u32),
) -> Result<Cubin> {
    let version = compiler()?.version;
    let Some(dir) = dir else {
        return compile(source, arch);
    };
    let path = dir.join(cache_name(source, arch, version));
    if let Some(hit) = read_cached(&path, source, arch) {
        return Ok(hit);
    }
    if let Err(e) = std::fs::create_dir_all(dir) {
        tracing::warn!("cubin cache {}: {e}; compiling without it", dir.display());
        return compile(source, arch);
    }
    // One compiler per cache entry at a time: the others wait for its file.
    let lock = match std::fs::File::create(path.with_extension("lock")) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("cubin cache {}: {e}; compiling without it", dir.display());
            return compile(source, arch);
        }
    };
    // SAFETY: flock on a file this function holds open; released when it is closed.
    unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
    if let Some(hit) = read_cached(&path, source, arch) {
        return Ok(hit);
    }
    let started = std::time::Instant::now();
    let compiled = compile(source, arch)?;
    tracing::info!(
        "NVRTC compiled {} for sm_{}{} in {:.1} s; cached as {}",
        source.name,
        arch.0,
        arch.1,
        started.elapsed().as_secs_f64(),
        path.display()
    );
    if let Err(e) = write_cached(&path, &compiled) {
        tracing::warn!("cubin cache {}: {e}", path.display());
    }
    Ok(compiled)
}

/// The cached image and log at `path` (the log beside it), if both are there.
fn read_cached(path: &Path, source: &KernelSource, arch: (u32, u32)) -> Option<Cubin> {
    let image = std::fs::read(path).ok()?;
    let log = std::fs::read_to_string(path.with_extension("log")).ok()?;
    if !image.starts_with(b"\x7fELF") {
        return None;
    }
    Some(Cubin {
        source: source.name,
        arch,
        image,
        log,
    })
}

/// Writes the log, then the image, each through a temporary file renamed into place, so
/// that a reader finds a whole image with its log or nothing.
fn write_cached(path: &Path, cubin: &Cubin) -> std::io::Result<()> {
    let atomically = |to: PathBuf, bytes: &[u8]| -> std::io::Result<()> {
        let tmp = to.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &to)
    };
    atomically(path.with_extension("log"), cubin.log.as_bytes())?;
    atomically(path.to_path_buf(), &cubin.image)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_older_than_nvrtc_is_refused_naming_both() {
        assert!(check_driver_supports((13, 2), 13000).is_ok());
        assert!(check_driver_supports((12, 8), 13020).is_ok());
        let err = check_driver_supports((13, 2), 12080)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("NVRTC 13.2") && err.contains("CUDA 12.8") && err.contains("12080"),
            "{err}"
        );
    }

    #[test]
    fn cache_names_differ_by_source_architecture_and_compiler() {
        let a = cache_name(&EXECUTOR, (9, 0), (13, 2));
        assert!(
            a.starts_with("executor-sm_90-nvrtc13.2-") && a.ends_with(".cubin"),
            "{a}"
        );
        assert_eq!(a, cache_name(&EXECUTOR, (9, 0), (13, 2)));
        assert_ne!(a, cache_name(&EXECUTOR, (8, 0), (13, 2)));
        assert_ne!(a, cache_name(&EXECUTOR, (9, 0), (13, 1)));
        assert_ne!(a, cache_name(&REDUCE, (9, 0), (13, 2)));
    }

    #[test]
    fn a_cached_image_is_read_back_whole_or_not_at_all() {
        let dir = std::env::temp_dir().join(format!("ferroccl-cubin-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(cache_name(&REDUCE, (9, 0), (13, 2)));
        assert!(read_cached(&path, &REDUCE, (9, 0)).is_none());
        let cubin = Cubin {
            source: REDUCE.name,
            arch: (9, 0),
            image: b"\x7fELF and the rest".to_vec(),
            log: "ptxas info".into(),
        };
        write_cached(&path, &cubin).unwrap();
        let back = read_cached(&path, &REDUCE, (9, 0)).unwrap();
        assert_eq!((back.image, back.log), (cubin.image, cubin.log));
        // Not an ELF image: not a hit.
        std::fs::write(&path, b"garbage").unwrap();
        assert!(read_cached(&path, &REDUCE, (9, 0)).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
