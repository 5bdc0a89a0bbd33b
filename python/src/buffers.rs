//! Memory that Python lends to a collective: CPU torch tensors (by their data pointer)
//! and any object with the buffer protocol (numpy arrays, `bytearray`, `memoryview`).
//!
//! Nothing is copied: a [`Lent`] is the object's own memory, kept alive (and, for the
//! buffer protocol, exported) for as long as the [`Lent`] lives. What the elements are
//! decides how a reduction runs on them ([`Elements::for_call`]), as PyTorch's NCCL
//! backend decides it: `bool` reduces as `uint8` (sum as max, product as min), complex
//! numbers as pairs of reals (sum, average and pre-multiplied sum only), and types NCCL
//! has no reduction for (`int16`, …) only move.

use std::ffi::{CStr, c_char, c_int, c_void};

use ferroccl::{DataType, Error, ReduceOp};
use pyo3::ffi;
use pyo3::prelude::*;

/// What the elements of a lent buffer are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elements {
    /// One of NCCL's twelve types.
    Typed(DataType),
    /// `bool`, one byte each (0 or 1).
    Bool,
    /// Complex numbers: pairs of the real type.
    Complex(DataType),
    /// Elements of this many bytes that ferroccl can move but not reduce (`int16`, …).
    Opaque {
        /// Size of one element in bytes.
        size: usize,
        /// Its name, for errors.
        name: &'static str,
    },
}

impl Elements {
    /// int16 and uint16: moved, never reduced (NCCL has no 16-bit integers).
    const SIXTEEN_BIT: [Elements; 2] = [
        Elements::Opaque {
            size: 2,
            name: "int16",
        },
        Elements::Opaque {
            size: 2,
            name: "uint16",
        },
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Elements::Typed(t) => t.size(),
            Elements::Bool => 1,
            Elements::Complex(t) => 2 * t.size(),
            Elements::Opaque { size, .. } => size,
        }
    }

    /// Its name, as torch prints it (without `torch.`).
    pub fn name(self) -> String {
        match self {
            Elements::Typed(t) => torch_name(t).into(),
            Elements::Bool => "bool".into(),
            Elements::Complex(DataType::Float16) => "complex32".into(),
            Elements::Complex(DataType::Float32) => "complex64".into(),
            Elements::Complex(_) => "complex128".into(),
            Elements::Opaque { name, .. } => name.into(),
        }
    }

    /// The type and reduction a call on these elements runs with, and how many of that
    /// type one element is. `op` is `None` for calls that only move data (any element
    /// type can be moved, as bytes if need be).
    pub fn for_call(
        self,
        call: &str,
        op: Option<ReduceOp>,
    ) -> ferroccl::Result<(DataType, ReduceOp, usize)> {
        let Some(op) = op else {
            return Ok(match self {
                Elements::Typed(t) => (t, ReduceOp::Sum, 1),
                Elements::Bool => (DataType::Uint8, ReduceOp::Sum, 1),
                Elements::Complex(t) => (t, ReduceOp::Sum, 2),
                Elements::Opaque { size, .. } => (DataType::Uint8, ReduceOp::Sum, size),
            });
        };
        let unsupported = |why: String| {
            Err(Error::invalid(format!(
                "{call}: {} on {} tensors is not supported: {why}",
                op_name(op),
                self.name()
            )))
        };
        match self {
            Elements::Typed(t) => Ok((t, op, 1)),
            // As PyTorch's NCCL backend: a logical or and a logical and.
            Elements::Bool => match op {
                ReduceOp::Sum | ReduceOp::Max => Ok((DataType::Uint8, ReduceOp::Max, 1)),
                ReduceOp::Prod | ReduceOp::Min => Ok((DataType::Uint8, ReduceOp::Min, 1)),
                _ => unsupported("bool tensors reduce with SUM, PRODUCT, MIN or MAX".into()),
            },
            // Sums of complex numbers are sums of their real and imaginary parts; a
            // real factor scales both. Products and orderings are not element-wise.
            Elements::Complex(t) => match op {
                ReduceOp::Sum | ReduceOp::Avg => Ok((t, op, 2)),
                ReduceOp::PreMulSum(ferroccl::Scalar::Float(_)) => Ok((t, op, 2)),
                _ => unsupported(
                    "complex tensors reduce with SUM, AVG or PREMUL_SUM (by a real factor)".into(),
                ),
            },
            Elements::Opaque { .. } => unsupported(
                "NCCL has no reduction for this type (it can be broadcast, gathered, \
                 scattered and sent)"
                    .into(),
            ),
        }
    }
}

/// The name torch gives a type (`float32`, not nccl-tests' `float`).
pub fn torch_name(t: DataType) -> &'static str {
    match t {
        DataType::Float16 => "float16",
        DataType::Float32 => "float32",
        DataType::Float64 => "float64",
        DataType::Float8E4M3 => "float8_e4m3fn",
        DataType::Float8E5M2 => "float8_e5m2",
        other => other.name(),
    }
}

/// The name torch gives a reduction.
pub fn op_name(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "SUM",
        ReduceOp::Prod => "PRODUCT",
        ReduceOp::Max => "MAX",
        ReduceOp::Min => "MIN",
        ReduceOp::Avg => "AVG",
        ReduceOp::PreMulSum(_) => "PREMUL_SUM",
    }
}

/// A torch dtype, by its name without `torch.`.
fn torch_elements(name: &str) -> Option<Elements> {
    Some(match name {
        "bool" => Elements::Bool,
        "complex32" | "chalf" => Elements::Complex(DataType::Float16),
        "complex64" | "cfloat" => Elements::Complex(DataType::Float32),
        "complex128" | "cdouble" => Elements::Complex(DataType::Float64),
        "float8_e4m3fn" => Elements::Typed(DataType::Float8E4M3),
        "float8_e5m2" => Elements::Typed(DataType::Float8E5M2),
        "int16" | "short" => Elements::SIXTEEN_BIT[0],
        "uint16" => Elements::SIXTEEN_BIT[1],
        "float8_e4m3fnuz" | "float8_e5m2fnuz" | "float8_e8m0fnu" | "int4" | "uint4" | "qint8"
        | "quint8" => Elements::Opaque {
            size: 1,
            name: "a type without an NCCL reduction",
        },
        other => Elements::Typed(other.parse().ok()?),
    })
}

/// A CUDA Array Interface `typestr` (`<f4`, `|i1`, …; little-endian or byte-sized).
fn cuda_array_elements(typestr: &str) -> Option<Elements> {
    let mut chars = typestr.chars();
    let order = chars.next()?;
    let kind = chars.next()?;
    let size: usize = chars.as_str().parse().ok()?;
    if order == '>' && size > 1 {
        return None;
    }
    Some(Elements::Typed(match (kind, size) {
        ('b', 1) => return Some(Elements::Bool),
        ('i', 1) => DataType::Int8,
        ('u', 1) => DataType::Uint8,
        ('i', 4) => DataType::Int32,
        ('u', 4) => DataType::Uint32,
        ('i', 8) => DataType::Int64,
        ('u', 8) => DataType::Uint64,
        ('f', 2) => DataType::Float16,
        ('f', 4) => DataType::Float32,
        ('f', 8) => DataType::Float64,
        ('c', 8) => return Some(Elements::Complex(DataType::Float32)),
        ('c', 16) => return Some(Elements::Complex(DataType::Float64)),
        ('i', 2) => return Some(Elements::SIXTEEN_BIT[0]),
        ('u', 2) => return Some(Elements::SIXTEEN_BIT[1]),
        _ => return None,
    }))
}

/// A buffer-protocol format character (after any byte-order prefix).
fn format_elements(format: &str, itemsize: usize) -> Option<Elements> {
    let code = format.trim_start_matches(['@', '=', '<', '>', '!']);
    let t = match (code, itemsize) {
        ("b", 1) => DataType::Int8,
        ("B" | "c", 1) => DataType::Uint8,
        ("?", 1) => return Some(Elements::Bool),
        ("e", 2) => DataType::Float16,
        ("f", 4) => DataType::Float32,
        ("d", 8) => DataType::Float64,
        ("i" | "l" | "q", 4) => DataType::Int32,
        ("I" | "L" | "Q", 4) => DataType::Uint32,
        ("i" | "l" | "q" | "n", 8) => DataType::Int64,
        ("I" | "L" | "Q" | "N", 8) => DataType::Uint64,
        ("Zf", 8) => return Some(Elements::Complex(DataType::Float32)),
        ("Zd", 16) => return Some(Elements::Complex(DataType::Float64)),
        ("h", 2) => return Some(Elements::SIXTEEN_BIT[0]),
        ("H", 2) => return Some(Elements::SIXTEEN_BIT[1]),
        _ => return None,
    };
    Some(Elements::Typed(t))
}

/// A Python object's memory, lent to a call (while the interpreter is attached).
pub struct Lent<'py> {
    /// First byte.
    pub ptr: *mut u8,
    /// Length in bytes.
    pub bytes: usize,
    /// What the elements are.
    pub elements: Elements,
    /// Whether the memory may be written (a read-only buffer can only be sent).
    pub writable: bool,
    /// The CUDA device of a CUDA tensor (`None`: host memory).
    pub device: Option<usize>,
    /// The stream a `__cuda_array_interface__` object names for its memory (0: the
    /// legacy default stream); `None` for tensors (torch's current stream is used).
    pub stream: Option<usize>,
    /// Keeps the memory alive (and exported) while a call uses it.
    pub keep: Bound<'py, PyAny>,
}

impl<'py> Lent<'py> {
    /// Elements of its type.
    pub fn len(&self) -> usize {
        self.bytes / self.elements.size()
    }

    /// Borrows the memory of `obj`: a CPU torch tensor, or an object with the buffer
    /// protocol (C-contiguous). `what` names the argument in errors; `write` asks for
    /// memory the call may write.
    pub fn borrow(obj: &Bound<'py, PyAny>, what: &str, write: bool) -> PyResult<Self> {
        if obj.hasattr(pyo3::intern!(obj.py(), "data_ptr"))? {
            return Self::tensor(obj, what);
        }
        if obj.hasattr(pyo3::intern!(obj.py(), "__cuda_array_interface__"))? {
            return Self::cuda_array(obj, what, write);
        }
        Self::buffer(obj, what, write)
    }

    /// CUDA device memory described by the CUDA Array Interface (version 2 or 3, as
    /// CuPy, Numba and others export it): C-contiguous, little-endian. Calls on it are
    /// enqueued on the stream it names (the legacy default stream when it names none).
    fn cuda_array(obj: &Bound<'py, PyAny>, what: &str, write: bool) -> PyResult<Self> {
        let py = obj.py();
        let bad = |why: String| crate::errors::value_error(format!("{what}: {why}"));
        let cai = obj.getattr(pyo3::intern!(py, "__cuda_array_interface__"))?;
        let shape: Vec<usize> = cai.get_item("shape")?.extract()?;
        let typestr: String = cai.get_item("typestr")?.extract()?;
        let (ptr, readonly): (usize, bool) = cai.get_item("data")?.extract()?;
        if let Ok(strides) = cai.get_item("strides")
            && !strides.is_none()
        {
            return Err(bad(
                "__cuda_array_interface__ has strides: ferroccl needs C-contiguous memory".into(),
            ));
        }
        let elements = cuda_array_elements(&typestr).ok_or_else(|| {
            bad(format!(
                "__cuda_array_interface__ typestr {typestr:?} is not a type ferroccl carries"
            ))
        })?;
        if write && readonly {
            return Err(bad("__cuda_array_interface__ memory is read-only".into()));
        }
        let bytes = shape.iter().product::<usize>() * elements.size();
        let device = if bytes == 0 {
            ferroccl::cuda::current_context()
                .ok()
                .flatten()
                .and_then(|c| c.device().ok())
        } else {
            Some(ferroccl::cuda::pointer_device(ptr as u64).map_err(|e| bad(e.to_string()))?)
        };
        let stream = match cai.get_item("stream") {
            Ok(s) if !s.is_none() => match s.extract::<usize>()? {
                1 => 0,
                2 => {
                    return Err(bad(
                        "the per-thread default stream (2) is not supported: pass a stream \
                         of your own"
                            .into(),
                    ));
                }
                s => s,
            },
            _ => 0,
        };
        Ok(Lent {
            ptr: ptr as *mut u8,
            bytes,
            elements,
            writable: !readonly,
            device,
            stream: Some(stream),
            keep: obj.clone(),
        })
    }

    fn tensor(t: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        let py = t.py();
        let on_cpu = t
            .getattr(pyo3::intern!(py, "is_cpu"))
            .and_then(|c| c.extract::<bool>())
            .unwrap_or(false);
        let on_cuda = t
            .getattr(pyo3::intern!(py, "is_cuda"))
            .and_then(|c| c.extract::<bool>())
            .unwrap_or(false);
        let mut device = None;
        if on_cuda {
            let index: Option<usize> = t
                .getattr(pyo3::intern!(py, "device"))?
                .getattr(pyo3::intern!(py, "index"))?
                .extract()?;
            device = Some(index.unwrap_or(0));
        } else if !on_cpu {
            let kind: String = t
                .getattr(pyo3::intern!(py, "device"))?
                .getattr(pyo3::intern!(py, "type"))?
                .extract()?;
            return Err(crate::errors::value_error(format!(
                "{what} is a {kind} tensor: ferroccl runs collectives on CPU memory, and on \
                 CUDA tensors through the torch backend"
            )));
        }
        let dtype: String = t.getattr(pyo3::intern!(py, "dtype"))?.str()?.extract()?;
        let name = dtype.strip_prefix("torch.").unwrap_or(&dtype);
        let elements = torch_elements(name).ok_or_else(|| {
            crate::errors::value_error(format!(
                "{what} has dtype {dtype}, which ferroccl cannot carry"
            ))
        })?;
        if !t
            .call_method0(pyo3::intern!(py, "is_contiguous"))?
            .extract::<bool>()?
        {
            return Err(crate::errors::value_error(format!(
                "{what} is not contiguous: call .contiguous() first (ferroccl works in \
                 the tensor's own memory)"
            )));
        }
        let ptr: usize = t.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
        let bytes: usize = t.getattr(pyo3::intern!(py, "nbytes"))?.extract()?;
        Ok(Lent {
            ptr: ptr as *mut u8,
            bytes,
            elements,
            writable: true,
            device,
            stream: None,
            keep: t.clone(),
        })
    }

    fn buffer(obj: &Bound<'py, PyAny>, what: &str, write: bool) -> PyResult<Self> {
        let py = obj.py();
        let export = Export::new(obj, what, write)?;
        let view = &export.view;
        let format = if view.format.is_null() {
            "B".to_string()
        } else {
            // SAFETY: a non-NULL format is a NUL-terminated string owned by the view.
            unsafe { CStr::from_ptr(view.format) }
                .to_string_lossy()
                .into_owned()
        };
        let itemsize = usize::try_from(view.itemsize).unwrap_or(0);
        let elements = format_elements(&format, itemsize).ok_or_else(|| {
            crate::errors::value_error(format!(
                "{what} holds elements of buffer format {format:?} ({itemsize} bytes), \
                 which ferroccl cannot carry"
            ))
        })?;
        let (ptr, bytes, writable) = (
            view.buf as *mut u8,
            usize::try_from(view.len).unwrap_or(0),
            view.readonly == 0,
        );
        Ok(Lent {
            ptr,
            bytes,
            elements,
            writable,
            device: None,
            stream: None,
            keep: Bound::new(py, export)?.into_any(),
        })
    }
}

/// `Py_buffer`, as CPython has laid it out since 3.3. pyo3 declares it only for the
/// stable ABI of 3.11 on (when it joined the limited API unchanged); this module is
/// built for the stable ABI of 3.9, so it declares the struct and the two functions
/// itself.
#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
}

const PYBUF_WRITABLE: c_int = 0x0001;
const PYBUF_FORMAT: c_int = 0x0004;
const PYBUF_ND: c_int = 0x0008;
const PYBUF_STRIDES: c_int = 0x0010 | PYBUF_ND;
const PYBUF_C_CONTIGUOUS: c_int = 0x0020 | PYBUF_STRIDES;

/// An exported buffer, released when the last reference to it goes (always with the
/// interpreter attached: it is a Python object).
#[pyclass(module = "ferroccl._ferroccl")]
struct Export {
    view: PyBufferView,
}

// SAFETY: the view is only read (its pointer and sizes) and released by the Python
// object's destructor, which runs with the interpreter attached; the memory it points
// to is shared with calls only through the `Lent` contract.
unsafe impl Send for Export {}
// SAFETY: as above: nothing mutates the view after it was filled.
unsafe impl Sync for Export {}

impl Export {
    fn new(obj: &Bound<'_, PyAny>, what: &str, write: bool) -> PyResult<Self> {
        let mut view = PyBufferView {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        };
        let flags = PYBUF_C_CONTIGUOUS | PYBUF_FORMAT | if write { PYBUF_WRITABLE } else { 0 };
        // SAFETY: `obj` is a live object (we hold it) and `view` a zeroed Py_buffer.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut view, flags) };
        if rc != 0 {
            let cause = PyErr::take(obj.py())
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(crate::errors::value_error(format!(
                "{what} ({}) must be a CPU torch tensor or a C-contiguous{} buffer \
                 (numpy array, bytearray, memoryview): {cause}",
                obj.get_type().name()?,
                if write { ", writable" } else { "" }
            )));
        }
        Ok(Export { view })
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful PyObject_GetBuffer and is
        // released once; a pyclass is dropped with the interpreter attached.
        unsafe { PyBuffer_Release(&mut self.view) };
    }
}
