//! LightGBM's C API (`lib_lightgbm.so`, loaded at run time): a booster from a model text file and
//! its prediction over a dense row-major FP32 batch (a prepared single-row path for batch 1).
use std::{
    ffi::{CString, c_char, c_int, c_void},
    path::Path,
    sync::Arc,
};

use super::Forest;
use crate::backend::library::{self, symbol};

type Handle = *mut c_void;

/// `C_API_DTYPE_FLOAT32` and `C_API_PREDICT_NORMAL` of LightGBM's c_api.h.
const FLOAT32: c_int = 0;
const PREDICT_NORMAL: c_int = 0;

pub struct Api {
    last_error: unsafe extern "C" fn() -> *const c_char,
    from_string: unsafe extern "C" fn(*const c_char, *mut c_int, *mut Handle) -> c_int,
    free: unsafe extern "C" fn(Handle) -> c_int,
    num_classes: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    num_feature: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    #[allow(clippy::type_complexity)]
    predict_mat: unsafe extern "C" fn(
        Handle,
        *const c_void,
        c_int,
        i32,
        i32,
        c_int,
        c_int,
        c_int,
        c_int,
        *const c_char,
        *mut i64,
        *mut f64,
    ) -> c_int,
    #[allow(clippy::type_complexity)]
    row_init: unsafe extern "C" fn(Handle, c_int, c_int, c_int, c_int, i32, *const c_char, *mut Handle) -> c_int,
    row_predict: unsafe extern "C" fn(Handle, *const c_void, *mut i64, *mut f64) -> c_int,
    fast_free: unsafe extern "C" fn(Handle) -> c_int,
    /// Last: the entry points above live as long as it.
    _library: libloading::Library,
}

impl Api {
    pub fn load(path: &Path) -> Result<Api, String> {
        // SAFETY: loading runs the library's initialisers; LightGBM's are plain C++ statics.
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| format!("cannot load LightGBM from '{}': {e}", path.display()))?;
        Ok(Api {
            last_error: symbol!(lib, "LightGBM", "LGBM_GetLastError"),
            from_string: symbol!(lib, "LightGBM", "LGBM_BoosterLoadModelFromString"),
            free: symbol!(lib, "LightGBM", "LGBM_BoosterFree"),
            num_classes: symbol!(lib, "LightGBM", "LGBM_BoosterGetNumClasses"),
            num_feature: symbol!(lib, "LightGBM", "LGBM_BoosterGetNumFeature"),
            predict_mat: symbol!(lib, "LightGBM", "LGBM_BoosterPredictForMat"),
            row_init: symbol!(lib, "LightGBM", "LGBM_BoosterPredictForMatSingleRowFastInit"),
            row_predict: symbol!(lib, "LightGBM", "LGBM_BoosterPredictForMatSingleRowFast"),
            fast_free: symbol!(lib, "LightGBM", "LGBM_FastConfigFree"),
            _library: lib,
        })
    }

    fn check(&self, rc: c_int, what: &str) -> Result<(), String> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: LGBM_GetLastError returns a NUL-terminated, thread-local string.
        let msg = unsafe { library::text((self.last_error)()) };
        Err(format!("LightGBM {what} failed: {}", tidy(&msg)))
    }
}

pub struct Booster {
    api: Arc<Api>,
    handle: Handle,
    /// The prepared single-row prediction (null until made).
    row: Handle,
    features: usize,
    width: usize,
    parameters: CString,
    scores: Vec<f64>,
    probabilities: bool,
}

// SAFETY: a booster is used by one thread at a time (`&mut self`).
unsafe impl Send for Booster {}

impl Drop for Booster {
    fn drop(&mut self) {
        // SAFETY: each handle came from LightGBM and is freed once, the prepared row first.
        unsafe {
            if !self.row.is_null() {
                (self.api.fast_free)(self.row);
            }
            (self.api.free)(self.handle);
        }
    }
}

impl Booster {
    /// Loads a checked model (`info`, read from `path`) with `threads` threads.
    pub fn load(api: Arc<Api>, info: &super::check::LgbInfo, path: &Path, threads: usize) -> Result<Booster, String> {
        let text = CString::new(info.text.as_str()).map_err(|_| "the model holds a NUL byte".to_string())?;
        let (mut iterations, mut handle) = (0 as c_int, std::ptr::null_mut());
        // SAFETY: `text` outlives the call, which copies what it keeps; the outputs receive the
        // count and the booster.
        let rc = unsafe { (api.from_string)(text.as_ptr(), &mut iterations, &mut handle) };
        api.check(rc, &format!("loading '{}'", path.display()))?;
        drop(text);
        let parameters = CString::new(format!("num_threads={}", threads.max(1))).expect("no NUL");
        let probabilities = matches!(
            info.objective.as_str(),
            "binary" | "multiclass" | "multiclassova" | "cross_entropy" | "xentropy" | "softmax" | "ova"
        );
        let mut b = Booster {
            api,
            handle,
            row: std::ptr::null_mut(),
            features: 0,
            width: 1,
            parameters,
            scores: Vec::new(),
            probabilities,
        };
        let api = Arc::clone(&b.api);
        let (mut classes, mut features) = (0 as c_int, 0 as c_int);
        // SAFETY: the outputs receive the counts.
        api.check(unsafe { (api.num_classes)(b.handle, &mut classes) }, "reading the class count")?;
        api.check(unsafe { (api.num_feature)(b.handle, &mut features) }, "reading the feature count")?;
        b.width =
            usize::try_from(classes).ok().filter(|&c| (1..=super::MAX_CLASSES).contains(&c)).ok_or_else(|| {
                format!("the model has {classes} classes; ferry takes tree models of 1 to {}", super::MAX_CLASSES)
            })?;
        b.features = usize::try_from(features).ok().filter(|&f| f <= super::MAX_FEATURES).ok_or_else(|| {
            format!("the model has {features} features; ferry takes tree models of up to {}", super::MAX_FEATURES)
        })?;
        let cols = i32::try_from(b.features).map_err(|_| "LightGBM model has too many features".to_string())?;
        // SAFETY: `parameters` outlives the call; `row` receives the prepared prediction.
        let rc = unsafe {
            (api.row_init)(b.handle, PREDICT_NORMAL, 0, -1, FLOAT32, cols, b.parameters.as_ptr(), &mut b.row)
        };
        api.check(rc, "preparing single-row prediction")?;
        Ok(b)
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
        false
    }

    fn gives_probabilities(&self) -> bool {
        self.probabilities
    }

    fn predict(&mut self, data: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), String> {
        let want = rows.checked_mul(self.width).ok_or("batch too large")?;
        let nrow = i32::try_from(rows).map_err(|_| format!("{rows} rows is more than LightGBM takes"))?;
        self.scores.clear();
        self.scores.resize(want, 0.0);
        let mut written = 0i64;
        // SAFETY: `data` holds rows × features floats (checked by the caller) and `scores` room for
        // rows × classes values, both outliving the call.
        let rc = unsafe {
            if rows == 1 {
                (self.api.row_predict)(self.row, data.as_ptr().cast(), &mut written, self.scores.as_mut_ptr())
            } else {
                (self.api.predict_mat)(
                    self.handle,
                    data.as_ptr().cast(),
                    FLOAT32,
                    nrow,
                    self.features as i32,
                    1,
                    PREDICT_NORMAL,
                    0,
                    -1,
                    self.parameters.as_ptr(),
                    &mut written,
                    self.scores.as_mut_ptr(),
                )
            }
        };
        self.api.check(rc, "predicting")?;
        if usize::try_from(written).ok() != Some(want) {
            return Err(format!("LightGBM wrote {written} values for {rows} rows of {} classes", self.width));
        }
        out.clear();
        out.extend(self.scores.iter().map(|&v| v as f32));
        Ok(())
    }
}

/// LightGBM's message without the source location it appends (" at /path/file.h, line 12 .").
fn tidy(msg: &str) -> &str {
    let msg = msg.trim();
    match msg.rfind(" at /") {
        Some(at) if msg[at..].contains(", line ") => msg[..at].trim_end(),
        _ => msg,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn messages_lose_their_source_location() {
        let raw = "Check failed: (strs.size()) == (n) at /__w/LightGBM/include/LightGBM/utils/common.h, line 1173 .";
        assert_eq!(super::tidy(raw), "Check failed: (strs.size()) == (n)");
        assert_eq!(super::tidy("plain"), "plain");
    }
}
