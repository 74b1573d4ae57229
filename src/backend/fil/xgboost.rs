//! XGBoost's C API (`libxgboost.so`, loaded at run time): a booster from a checked model file
//! (JSON or UBJSON, told apart by XGBoost from the bytes) and its in-place
//! prediction over a dense row-major FP32 batch.
use std::{
    ffi::{CString, c_char, c_int, c_void},
    path::Path,
    sync::Arc,
};

use super::Forest;
use crate::backend::library::{self, symbol};

type Handle = *mut c_void;

/// The entry points ferry calls, resolved once from the library.
pub struct Api {
    last_error: unsafe extern "C" fn() -> *const c_char,
    create: unsafe extern "C" fn(*const Handle, u64, *mut Handle) -> c_int,
    free: unsafe extern "C" fn(Handle) -> c_int,
    load_buffer: unsafe extern "C" fn(Handle, *const c_void, u64) -> c_int,
    set_param: unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> c_int,
    num_feature: unsafe extern "C" fn(Handle, *mut u64) -> c_int,
    predict_dense: unsafe extern "C" fn(
        Handle,
        *const c_char,
        *const c_char,
        Handle,
        *mut *const u64,
        *mut u64,
        *mut *const f32,
    ) -> c_int,
    /// Last: the entry points above live as long as it.
    _library: libloading::Library,
}

impl Api {
    pub fn load(path: &Path) -> Result<Api, String> {
        // SAFETY: loading runs the library's initialisers; XGBoost's are plain C++ statics.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load XGBoost from '{}': {e}", path.display()))?;
        Ok(Api {
            last_error: symbol!(lib, "XGBoost", "XGBGetLastError"),
            create: symbol!(lib, "XGBoost", "XGBoosterCreate"),
            free: symbol!(lib, "XGBoost", "XGBoosterFree"),
            load_buffer: symbol!(lib, "XGBoost", "XGBoosterLoadModelFromBuffer"),
            set_param: symbol!(lib, "XGBoost", "XGBoosterSetParam"),
            num_feature: symbol!(lib, "XGBoost", "XGBoosterGetNumFeature"),
            predict_dense: symbol!(lib, "XGBoost", "XGBoosterPredictFromDense"),
            _library: lib,
        })
    }

    /// `Ok` when `rc` is 0, else XGBoost's own message for what failed.
    fn check(&self, rc: c_int, what: &str) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: XGBGetLastError returns a NUL-terminated, thread-local string (or null).
        let msg = unsafe { library::text((self.last_error)()) };
        Err(format!("XGBoost {what} failed: {}", tidy(&msg)))
    }
}

/// XGBoost's message without the time, source location and stack trace it wraps it in.
fn tidy(msg: &str) -> &str {
    let msg = msg.split("Stack trace:").next().unwrap_or(msg).trim();
    let located = msg
        .strip_prefix('[')
        .and_then(|m| m.split_once("] "))
        .and_then(|(_, rest)| rest.split_once(": "))
        .filter(|(at, _)| at.contains(':') && !at.contains(' '));
    located.map_or(msg, |(_, text)| text.trim())
}

pub struct Booster {
    api: Arc<Api>,
    handle: Handle,
    features: usize,
    width: usize,
    /// Targets of a multi-target model (each row's values are one per target).
    targets: usize,
    classes: bool,
    probabilities: bool,
    /// The prediction settings, as the JSON XGBoost reads each call.
    config: CString,
}

// SAFETY: a booster is used by one thread at a time (`&mut self`); XGBoost boosters may move
// between threads.
unsafe impl Send for Booster {}

impl Drop for Booster {
    fn drop(&mut self) {
        // SAFETY: the handle came from XGBoosterCreate and is freed once.
        unsafe { (self.api.free)(self.handle) };
    }
}

impl Booster {
    /// Loads a model file's `bytes` (checked: `info`) with `threads` threads; `gpu`: the CUDA
    /// device to predict on.
    pub fn load(
        api: Arc<Api>,
        bytes: &[u8],
        path: &Path,
        info: &super::check::XgbInfo,
        threads: usize,
        gpu: Option<i32>,
    ) -> Result<Booster, String> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: no training matrices (null, 0); `handle` receives the booster.
        api.check(unsafe { (api.create)(std::ptr::null(), 0, &mut handle) }, "creating a booster")?;
        // From here the booster is freed on every path (Drop).
        let mut b = Booster {
            api,
            handle,
            features: 0,
            width: 1,
            targets: info.targets,
            classes: info.objective == "multi:softmax",
            probabilities: matches!(info.objective.split(':').next(), Some("binary" | "multi"))
                || info.objective == "reg:logistic",
            config: CString::new(
                r#"{"type":0,"training":false,"iteration_begin":0,"iteration_end":0,"strict_shape":false,"missing":NaN,"cache_id":0}"#,
            )
            .expect("no NUL"),
        };
        let api = Arc::clone(&b.api);
        // SAFETY: the buffer outlives the call; XGBoost copies what it keeps.
        let rc = unsafe { (api.load_buffer)(b.handle, bytes.as_ptr().cast(), bytes.len() as u64) };
        api.check(rc, &format!("loading '{}'", path.display()))?;
        b.set("nthread", &threads.max(1).to_string())?;
        if let Some(gpu) = gpu {
            b.set("device", &format!("cuda:{gpu}"))?;
        }
        let mut n = 0u64;
        // SAFETY: `n` receives the count.
        api.check(unsafe { (api.num_feature)(b.handle, &mut n) }, "reading the feature count")?;
        b.features = usize::try_from(n).ok().filter(|&f| f <= super::MAX_FEATURES).ok_or_else(|| {
            format!("the model has {n} features; ferry takes tree models of up to {}", super::MAX_FEATURES)
        })?;
        // The width of a prediction, from one row of missing values.
        let probe = vec![f32::NAN; b.features.max(1)];
        let mut out = Vec::new();
        b.width = b.run(&probe, 1, &mut out)?;
        Ok(b)
    }

    fn set(&mut self, name: &str, value: &str) -> Result<(), String> {
        let (n, v) = (CString::new(name).expect("no NUL"), CString::new(value).expect("no NUL"));
        // SAFETY: both strings outlive the call.
        let rc = unsafe { (self.api.set_param)(self.handle, n.as_ptr(), v.as_ptr()) };
        self.api.check(rc, &format!("setting {name}={value}"))
    }

    /// Predicts `rows` rows; returns the values per row, written to `out`.
    fn run(&mut self, data: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<usize, String> {
        let cols = self.features.max(1);
        let array = CString::new(format!(
            r#"{{"data":[{},true],"shape":[{rows},{cols}],"typestr":"<f4","version":3}}"#,
            data.as_ptr() as usize
        ))
        .expect("no NUL");
        let (mut shape, mut dims, mut result) = (std::ptr::null::<u64>(), 0u64, std::ptr::null::<f32>());
        // SAFETY: `data` holds rows × cols floats and outlives the call; XGBoost returns its own
        // buffers, valid until the next call on this booster, copied out below.
        let rc = unsafe {
            (self.api.predict_dense)(
                self.handle,
                array.as_ptr(),
                self.config.as_ptr(),
                std::ptr::null_mut(),
                &mut shape,
                &mut dims,
                &mut result,
            )
        };
        self.api.check(rc, "predicting")?;
        let shape = unsafe { std::slice::from_raw_parts(shape, dims as usize) };
        let total = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?));
        let total = total
            .filter(|&t| rows > 0 && t % rows == 0)
            .ok_or_else(|| format!("XGBoost returned a prediction of shape {shape:?} for {rows} rows"))?;
        out.clear();
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(result, total) });
        Ok(total / rows)
    }
}

impl Forest for Booster {
    fn features(&self) -> usize {
        self.features
    }

    fn width(&self) -> usize {
        self.width
    }

    fn gives_classes(&self) -> bool {
        self.classes
    }

    fn targets(&self) -> usize {
        self.targets
    }

    fn gives_probabilities(&self) -> bool {
        self.probabilities
    }

    fn predict(&mut self, data: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), String> {
        let width = self.run(data, rows, out)?;
        if width != self.width {
            return Err(format!("XGBoost returned {width} values per row, {} at load", self.width));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn xgboost_messages_lose_their_wrapping() {
        let raw = "[18:01:58] /workspace/src/common/error_msg.cc:109: Invalid `base_score`, it should match.\n\
                   Stack trace:\n  [bt] (0) libxgboost.so(+0x11031e)";
        assert_eq!(super::tidy(raw), "Invalid `base_score`, it should match.");
        assert_eq!(super::tidy("plain words: here"), "plain words: here");
    }
}
