//! PyTorch's stable C tensor ABI in `libtorch_cpu.so` (`aoti_torch_*`,
//! torch/csrc/inductor/aoti_torch/c/shim.h), loaded at run time: tensors over ferry's bytes, and
//! tensors PyTorch hands back, read in row-major order. Every C++ exception stays on PyTorch's
//! side: each entry point returns an error code.
use std::{ffi::c_void, path::Path};

use crate::{backend::library::symbol, tensor::DataType};

/// `AtenTensorHandle`: a tensor PyTorch owns.
pub type TensorHandle = *mut c_void;

/// The tensor entry points of `libtorch_cpu.so`, resolved once; the library stays loaded for
/// the server's life (PyTorch is never unloaded).
pub struct Torch {
    from_blob:
        unsafe extern "C" fn(*mut c_void, i64, *const i64, *const i64, i64, i32, i32, i32, *mut TensorHandle) -> i32,
    delete: unsafe extern "C" fn(TensorHandle) -> i32,
    data_ptr: unsafe extern "C" fn(TensorHandle, *mut *mut c_void) -> i32,
    dim: unsafe extern "C" fn(TensorHandle, *mut i64) -> i32,
    sizes: unsafe extern "C" fn(TensorHandle, *mut *mut i64) -> i32,
    strides: unsafe extern "C" fn(TensorHandle, *mut *mut i64) -> i32,
    dtype: unsafe extern "C" fn(TensorHandle, *mut i32) -> i32,
    device_type: unsafe extern "C" fn(TensorHandle, *mut i32) -> i32,
    /// libgomp's, through libtorch's dependencies: the threads of this thread's next parallel
    /// regions (PyTorch's CPU kernels run on OpenMP).
    omp_threads: Option<unsafe extern "C" fn(i32)>,
    /// (datatype, PyTorch's dtype code).
    dtypes: Vec<(DataType, i32)>,
    cpu: i32,
    /// Where the library was loaded from (a trial process loads the same).
    pub path: std::path::PathBuf,
    _library: libloading::Library,
}

// SAFETY: the entry points are plain C functions PyTorch makes safe to call from any thread.
unsafe impl Send for Torch {}
unsafe impl Sync for Torch {}

impl Torch {
    pub fn load(path: &Path) -> Result<Torch, String> {
        // SAFETY: loading PyTorch runs its static initializers, which only register operators.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load PyTorch from '{}': {e}", path.display()))?;
        let code = |name: &str| -> Result<i32, String> {
            let symbol = format!("aoti_torch_{name}\0");
            // SAFETY: each `aoti_torch_dtype_*` / `aoti_torch_device_type_*` takes nothing and
            // returns an int32 code.
            let f: libloading::Symbol<unsafe extern "C" fn() -> i32> = unsafe { lib.get(symbol.as_bytes()) }
                .map_err(|e| format!("the PyTorch library has no aoti_torch_{name}: {e}"))?;
            // SAFETY: as above.
            Ok(unsafe { f() })
        };
        let pairs = [
            (DataType::Bool, "dtype_bool"),
            (DataType::Uint8, "dtype_uint8"),
            (DataType::Int8, "dtype_int8"),
            (DataType::Int16, "dtype_int16"),
            (DataType::Int32, "dtype_int32"),
            (DataType::Int64, "dtype_int64"),
            (DataType::Fp16, "dtype_float16"),
            (DataType::Bf16, "dtype_bfloat16"),
            (DataType::Fp32, "dtype_float32"),
            (DataType::Fp64, "dtype_float64"),
        ];
        let mut dtypes = pairs.iter().map(|(t, n)| Ok((*t, code(n)?))).collect::<Result<Vec<_>, String>>()?;
        // Newer PyTorch has the wider unsigned types too.
        for (t, n) in
            [(DataType::Uint16, "dtype_uint16"), (DataType::Uint32, "dtype_uint32"), (DataType::Uint64, "dtype_uint64")]
        {
            if let Ok(c) = code(n) {
                dtypes.push((t, c));
            }
        }
        let cpu = code("device_type_cpu")?;
        // SAFETY: omp_set_num_threads(int) is OpenMP's.
        let omp_threads = unsafe { lib.get::<unsafe extern "C" fn(i32)>(b"omp_set_num_threads\0") }.ok().map(|s| *s);
        Ok(Torch {
            from_blob: symbol!(lib, "PyTorch", "aoti_torch_create_tensor_from_blob"),
            delete: symbol!(lib, "PyTorch", "aoti_torch_delete_tensor_object"),
            data_ptr: symbol!(lib, "PyTorch", "aoti_torch_get_data_ptr"),
            dim: symbol!(lib, "PyTorch", "aoti_torch_get_dim"),
            sizes: symbol!(lib, "PyTorch", "aoti_torch_get_sizes"),
            strides: symbol!(lib, "PyTorch", "aoti_torch_get_strides"),
            dtype: symbol!(lib, "PyTorch", "aoti_torch_get_dtype"),
            device_type: symbol!(lib, "PyTorch", "aoti_torch_get_device_type"),
            omp_threads,
            dtypes,
            cpu,
            path: path.to_path_buf(),
            _library: lib,
        })
    }

    pub fn code(&self, datatype: DataType) -> Option<i32> {
        self.dtypes.iter().find(|(t, _)| *t == datatype).map(|(_, c)| *c)
    }

    fn datatype(&self, code: i32) -> Option<DataType> {
        self.dtypes.iter().find(|(_, c)| *c == code).map(|(t, _)| *t)
    }

    /// The threads PyTorch's kernels may use in the calls this thread makes next.
    pub fn set_threads(&self, n: usize) {
        if let Some(f) = self.omp_threads {
            // SAFETY: sets a per-thread OpenMP setting.
            unsafe { f(n.clamp(1, i32::MAX as usize) as i32) };
        }
    }

    /// A CPU tensor over `data` (row-major `shape`), which PyTorch may read and write until the
    /// handle is gone (the caller keeps `data` alive and untouched until then).
    pub fn lend(&self, data: &mut [u8], shape: &[i64], datatype: DataType) -> Result<Tensor<'_>, String> {
        let code = self.code(datatype).ok_or_else(|| format!("PyTorch has no {} tensors", datatype.wire()))?;
        let mut strides = vec![1i64; shape.len()];
        for k in (0..shape.len().saturating_sub(1)).rev() {
            strides[k] = strides[k + 1].saturating_mul(shape[k + 1].max(1));
        }
        let mut handle: TensorHandle = std::ptr::null_mut();
        // SAFETY: sizes and strides have ndim entries; the data is this caller's to lend.
        let err = unsafe {
            (self.from_blob)(
                data.as_mut_ptr() as *mut c_void,
                shape.len() as i64,
                shape.as_ptr(),
                strides.as_ptr(),
                0,
                code,
                self.cpu,
                0,
                &mut handle,
            )
        };
        if err != 0 || handle.is_null() {
            return Err(format!("PyTorch could not make a {} tensor of shape {shape:?}", datatype.wire()));
        }
        Ok(Tensor { torch: self, handle })
    }

    /// Takes a tensor PyTorch handed over (a model's output).
    ///
    /// # Safety
    /// `handle` is a live tensor that nothing else will delete.
    pub unsafe fn own(&self, handle: TensorHandle) -> Tensor<'_> {
        Tensor { torch: self, handle }
    }
}

/// A tensor handle, deleted when dropped unless `release`d to PyTorch.
pub struct Tensor<'t> {
    torch: &'t Torch,
    handle: TensorHandle,
}

impl Tensor<'_> {
    /// Hands the handle over (the container steals its inputs).
    pub fn release(self) -> TensorHandle {
        let h = self.handle;
        std::mem::forget(self);
        h
    }

    /// The tensor's datatype, shape and bytes in row-major order (a strided tensor is gathered).
    pub fn read(&self, max_bytes: usize) -> Result<(DataType, Vec<i64>, Vec<u8>), String> {
        let t = self.torch;
        let (mut code, mut ndim, mut device) = (0i32, 0i64, 0i32);
        let (mut sizes, mut strides, mut data): (*mut i64, *mut i64, *mut c_void) =
            (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: the handle is live; each getter writes through its pointer.
        let err = unsafe {
            (t.dtype)(self.handle, &mut code)
                | (t.dim)(self.handle, &mut ndim)
                | (t.device_type)(self.handle, &mut device)
                | (t.sizes)(self.handle, &mut sizes)
                | (t.strides)(self.handle, &mut strides)
                | (t.data_ptr)(self.handle, &mut data)
        };
        if err != 0 || !(0..=64).contains(&ndim) || (ndim > 0 && (sizes.is_null() || strides.is_null())) {
            return Err("PyTorch could not describe an output tensor".into());
        }
        if device != t.cpu {
            return Err("the model returned a tensor that is not in host memory".into());
        }
        let datatype = t.datatype(code).ok_or_else(|| {
            format!("the model returned a tensor of PyTorch dtype {code}, which has no KServe datatype")
        })?;
        let n = ndim as usize;
        // SAFETY: PyTorch's sizes and strides arrays have ndim entries, borrowed while the tensor lives.
        let (shape, strides) = if n == 0 {
            (Vec::new(), Vec::new())
        } else {
            unsafe { (std::slice::from_raw_parts(sizes, n).to_vec(), std::slice::from_raw_parts(strides, n).to_vec()) }
        };
        let element = datatype.size().unwrap_or(1);
        let count = shape.iter().try_fold(1usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)));
        let bytes = count.and_then(|c| c.checked_mul(element)).filter(|&b| b <= max_bytes).ok_or_else(|| {
            format!("the model returned a tensor of shape {shape:?}, over the {max_bytes} bytes an output may have")
        })?;
        if bytes == 0 {
            return Ok((datatype, shape, Vec::new()));
        }
        if data.is_null() {
            return Err("PyTorch gave an output tensor without data".into());
        }
        let mut out = vec![0u8; bytes];
        gather(data as *const u8, &shape, &strides, element, &mut out);
        Ok((datatype, shape, out))
    }
}

impl Drop for Tensor<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle is live and owned here.
        unsafe { (self.torch.delete)(self.handle) };
    }
}

/// Copies a strided tensor's elements into `out` in row-major order.
fn gather(base: *const u8, shape: &[i64], strides: &[i64], element: usize, out: &mut [u8]) {
    let contiguous = {
        let mut want = 1i64;
        let mut ok = true;
        for (&d, &s) in shape.iter().zip(strides).rev() {
            if d != 1 && s != want {
                ok = false;
            }
            want = want.saturating_mul(d);
        }
        ok
    };
    if contiguous {
        // SAFETY: a contiguous tensor's storage holds its elements from the data pointer on.
        unsafe { std::ptr::copy_nonoverlapping(base, out.as_mut_ptr(), out.len()) };
        return;
    }
    let mut index = vec![0i64; shape.len()];
    for chunk in out.chunks_exact_mut(element) {
        let offset: i64 = index.iter().zip(strides).map(|(&i, &s)| i * s).sum();
        // SAFETY: every index is within the tensor's sizes, so the element lies in its storage.
        unsafe {
            std::ptr::copy_nonoverlapping(base.offset((offset * element as i64) as isize), chunk.as_mut_ptr(), element)
        };
        for k in (0..shape.len()).rev() {
            index[k] += 1;
            if index[k] < shape[k] {
                break;
            }
            index[k] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_a_transposed_tensor_in_row_major_order() {
        // A 2x3 tensor stored as its 3x2 transpose: [[0,1,2],[3,4,5]] with strides (1, 2).
        let storage: Vec<u8> = vec![0, 3, 1, 4, 2, 5];
        let mut out = vec![0u8; 6];
        gather(storage.as_ptr(), &[2, 3], &[1, 2], 1, &mut out);
        assert_eq!(out, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn gathers_a_broadcast_row() {
        // One row of 2 four-byte elements repeated 3 times (stride 0 on the rows).
        let storage: Vec<u8> = vec![1, 0, 0, 0, 2, 0, 0, 0];
        let mut out = vec![0u8; 24];
        gather(storage.as_ptr(), &[3, 2], &[0, 1], 4, &mut out);
        assert_eq!(out, [1, 0, 0, 0, 2, 0, 0, 0].repeat(3));
    }

    #[test]
    fn a_contiguous_tensor_with_unit_dimensions_is_copied_whole() {
        let storage: Vec<u8> = (0..6).collect();
        let mut out = vec![0u8; 6];
        // Strides of size-1 dimensions do not matter.
        gather(storage.as_ptr(), &[1, 6, 1], &[99, 1, 7], 1, &mut out);
        assert_eq!(out, storage);
    }
}
