//! FIL's `model_type` parameter: which framework's format a tree model is in, and the file it is
//! read from when the config names none. Read by the repository (the file) and the FIL backend.
use crate::proto::inference::ModelConfig;

/// The model formats of FIL's `model_type`, and the file each is read from by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelType {
    Xgboost,
    XgboostJson,
    XgboostUbj,
    Lightgbm,
    TreeliteCheckpoint,
}

impl ModelType {
    /// FIL's `model_type` parameter (absent: `xgboost`, as FIL).
    pub fn of(config: &ModelConfig) -> std::result::Result<ModelType, String> {
        let given = config.parameters.get("model_type").map(|p| p.string_value.trim()).unwrap_or("xgboost");
        Ok(match given {
            "xgboost" => ModelType::Xgboost,
            "xgboost_json" => ModelType::XgboostJson,
            "xgboost_ubj" => ModelType::XgboostUbj,
            "lightgbm" => ModelType::Lightgbm,
            "treelite_checkpoint" => ModelType::TreeliteCheckpoint,
            other => {
                return Err(format!(
                    "model '{}': parameter model_type is '{other}'; expected xgboost, xgboost_json, xgboost_ubj, \
                     lightgbm or treelite_checkpoint",
                    config.name
                ));
            }
        })
    }

    /// The file FIL reads when `default_model_filename` is not given.
    pub fn default_file(self) -> &'static str {
        match self {
            ModelType::Xgboost => "xgboost.model",
            ModelType::XgboostJson => "xgboost.json",
            ModelType::XgboostUbj => "xgboost.ubj",
            ModelType::Lightgbm => "model.txt",
            ModelType::TreeliteCheckpoint => "checkpoint.tl",
        }
    }
}
