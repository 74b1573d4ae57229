//! Reading a model's config as the OpenAI roles need it: its string parameters and the datatypes
//! of its tensors.
use crate::{proto::inference::ModelConfig, tensor::DataType};

pub(super) fn param<'a>(c: &'a ModelConfig, key: &str) -> Option<&'a str> {
    c.parameters.get(key).map(|p| p.string_value.trim()).filter(|v| !v.is_empty())
}

pub(super) fn dtype(data_type: i32) -> Option<DataType> {
    DataType::from_config(data_type)
}

pub(super) fn is_float(d: Option<DataType>) -> bool {
    matches!(d, Some(DataType::Fp32 | DataType::Fp16 | DataType::Bf16 | DataType::Fp64))
}

pub(super) fn is_int(d: Option<DataType>) -> bool {
    matches!(
        d,
        Some(
            DataType::Int8
                | DataType::Int16
                | DataType::Int32
                | DataType::Int64
                | DataType::Uint8
                | DataType::Uint16
                | DataType::Uint32
                | DataType::Uint64
        )
    )
}
