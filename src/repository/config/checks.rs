//! Validation of an effective config (§5.4), and of config against what the model file declares.
use super::*;

fn check_dims(what: &str, name: &str, dims: &[i64], allow_empty: bool) -> Result<(), String> {
    if dims.is_empty() && !allow_empty {
        return Err(format!("{what} '{name}' must specify 'dims'"));
    }
    if let Some(bad) = dims.iter().find(|&&d| d != -1 && d < 1) {
        return Err(format!(
            "{what} '{name}' dims {}: dimension {bad} is invalid; dimension must be integer >= 1, or -1 to indicate a variable-size dimension",
            shape_string(dims)
        ));
    }
    Ok(())
}

fn check_reshape(
    what: &str,
    name: &str,
    dims: &[i64],
    reshape: Option<&ModelTensorReshape>,
    batching: bool,
) -> Result<(), String> {
    let Some(r) = reshape else { return Ok(()) };
    if r.shape.is_empty() && !batching {
        return Err(format!("{what} '{name}': an empty reshape is only allowed for models with max_batch_size > 0"));
    }
    check_dims(what, name, &r.shape, true)?;
    let count = |s: &[i64]| s.iter().filter(|&&d| d != -1).product::<i64>();
    let vars = |s: &[i64]| s.iter().filter(|&&d| d == -1).count();
    if count(dims) != count(&r.shape) || vars(dims) != vars(&r.shape) {
        return Err(format!(
            "{what} '{name}' has different size for dims {} and reshape {}",
            shape_string(dims),
            shape_string(&r.shape)
        ));
    }
    Ok(())
}

fn check_datatype(what: &str, name: &str, n: i32) -> Result<(), String> {
    DataType::from_config(n).map(|_| ()).ok_or_else(|| format!("{what} '{name}' must specify a valid 'data_type'"))
}

/// The rules of model-config.md §5.4 that apply to models ferry can run.
/// `batch_input` and `batch_output` as Triton checks them: one source input that exists, known
/// kinds, targets that are new inputs and existing outputs named once.
fn validate_batch_io(cfg: &ModelConfig) -> Result<(), String> {
    let known_input = |name: &str| cfg.input.iter().any(|i| i.name == name);
    let mut targets: Vec<&str> = Vec::new();
    for b in &cfg.batch_input {
        let kind = crate::schema::BatchInputKind::from_config(b.kind)
            .ok_or_else(|| format!("batch input kind {} is not a known kind", b.kind))?;
        if b.source_input.len() != 1 {
            return Err(format!(
                "batch input kind '{}' expects 1 source input, got {}",
                kind.config_name(),
                b.source_input.len()
            ));
        }
        if !known_input(&b.source_input[0]) {
            return Err(format!("unknown source input name '{}'", b.source_input[0]));
        }
        if b.target_name.is_empty() {
            return Err(format!("batch input kind '{}' expects a target_name", kind.config_name()));
        }
        let dt = DataType::from_config(b.data_type);
        if !matches!(dt, Some(DataType::Int32 | DataType::Int64 | DataType::Fp32)) {
            return Err(format!(
                "batch input '{}' must have data_type TYPE_INT32, TYPE_INT64 or TYPE_FP32",
                b.target_name[0]
            ));
        }
        for t in &b.target_name {
            if known_input(t) || targets.contains(&t.as_str()) {
                return Err(format!("batch input target name '{t}' is already an input of the model"));
            }
            targets.push(t);
        }
    }
    let mut scattered: Vec<&str> = Vec::new();
    for b in &cfg.batch_output {
        if b.kind != 0 {
            return Err(format!("batch output kind {} is not a known kind", b.kind));
        }
        if b.source_input.len() != 1 {
            return Err(format!(
                "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source input, got {}",
                b.source_input.len()
            ));
        }
        if !known_input(&b.source_input[0]) {
            return Err(format!("unknown source input name '{}'", b.source_input[0]));
        }
        for t in &b.target_name {
            if !cfg.output.iter().any(|o| &o.name == t) {
                return Err(format!("unknown target output name '{t}'"));
            }
            if scattered.contains(&t.as_str()) {
                return Err(format!("target output name '{t}' can only be specified once"));
            }
            scattered.push(t);
        }
    }
    Ok(())
}

pub fn validate(cfg: &ModelConfig) -> Result<(), String> {
    if cfg.max_batch_size < 0 {
        return Err(format!("max_batch_size must be >= 0, got {}", cfg.max_batch_size));
    }
    let batching = cfg.max_batch_size > 0;
    // A Python model may take nothing (a generator) or give nothing (a BLS driver), as in Triton.
    if (cfg.input.is_empty() || cfg.output.is_empty()) && !runs_python(cfg) {
        return Err(format!(
            "model '{}' must list at least one input and one output (or leave them to auto-complete)",
            cfg.name
        ));
    }
    for i in &cfg.input {
        if i.name.is_empty() {
            return Err("every input must specify 'name'".into());
        }
        check_datatype("input", &i.name, i.data_type)?;
        check_dims("input", &i.name, &i.dims, false)?;
        check_reshape("input", &i.name, &i.dims, i.reshape.as_ref(), batching)?;
    }
    for o in &cfg.output {
        if o.name.is_empty() {
            return Err("every output must specify 'name'".into());
        }
        check_datatype("output", &o.name, o.data_type)?;
        check_dims("output", &o.name, &o.dims, false)?;
        check_reshape("output", &o.name, &o.dims, o.reshape.as_ref(), batching)?;
    }
    validate_batch_io(cfg)?;
    let mut names: Vec<&str> = cfg.input.iter().map(|i| i.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("input '{}' is listed more than once", w[0]));
    }
    match &cfg.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(db)) => validate_dynamic_batching(db, cfg.max_batch_size)?,
        Some(SchedulingChoice::SequenceBatching(sb)) => validate_sequence_batching(cfg, sb)?,
        Some(SchedulingChoice::EnsembleScheduling(_)) if cfg.platform != "ensemble" => {
            return Err(format!("ensemble_scheduling needs platform: \"ensemble\" (model '{}')", cfg.name));
        }
        Some(SchedulingChoice::EnsembleScheduling(_)) => {}
        None => {}
    }
    if cfg.platform == "ensemble" {
        check_ensemble(cfg)?;
    }
    if cfg.model_transaction_policy.as_ref().is_some_and(|p| p.decoupled) && !runs_python(cfg) {
        return Err(format!(
            "model '{}': only Python models can be decoupled (model_transaction_policy.decoupled)",
            cfg.name
        ));
    }
    if cfg.model_transaction_policy.as_ref().is_some_and(|p| p.decoupled)
        && cfg.response_cache.as_ref().is_some_and(|c| c.enable)
    {
        return Err(format!("model '{}': the response cache cannot be used with a decoupled model", cfg.name));
    }
    check_instances(cfg)?;
    check_warmup(cfg)
}

/// Whether the model runs as Python: the Python backend, or a Python-based one (a backend ferry
/// does not build in; `fill` let it through only when its model.py was found).
fn runs_python(cfg: &ModelConfig) -> bool {
    !matches!(
        cfg.backend.as_str(),
        "onnxruntime" | "identity" | "ferry_image" | "ferry_tokenizer" | "ferry_postprocess" | ""
    )
}

/// What an ensemble's config may hold (its steps are checked against the models at load).
fn check_ensemble(cfg: &ModelConfig) -> Result<(), String> {
    let name = &cfg.name;
    if !cfg.backend.is_empty() {
        return Err(format!("ensemble '{name}' must not name a backend (got '{}')", cfg.backend));
    }
    if !matches!(cfg.scheduling_choice, Some(SchedulingChoice::EnsembleScheduling(_))) {
        return Err(format!("ensemble '{name}' must have ensemble_scheduling"));
    }
    if !cfg.instance_group.is_empty() {
        return Err(format!("instance group should not be specified for ensemble '{name}'"));
    }
    if !cfg.model_warmup.is_empty() {
        return Err(format!("model_warmup can not be specified for ensemble '{name}'"));
    }
    if cfg.optimization.is_some() {
        return Err(format!("optimization should not be specified for ensemble '{name}'"));
    }
    Ok(())
}

/// Most instances one model version may run (each holds a runtime session and its threads).
pub const MAX_INSTANCES: i64 = 128;
/// Most priority levels (each is a queue the batcher looks at for every batch).
pub const MAX_PRIORITY_LEVELS: u64 = 1024;
/// Most bytes one warm-up sample may allocate, and most runs of one sample.
pub const MAX_WARMUP_BYTES: u64 = 1 << 30;
pub const MAX_WARMUP_RUNS: u32 = 100_000;

fn check_instances(cfg: &ModelConfig) -> Result<(), String> {
    let mut total: i64 = 0;
    for g in &cfg.instance_group {
        let devices = if g.kind == Kind::Gpu as i32 { g.gpus.len().max(1) as i64 } else { 1 };
        total = total.saturating_add(i64::from(g.count.max(0)).saturating_mul(devices));
        if let Some(gpu) = g.gpus.iter().find(|&&d| d < 0) {
            return Err(format!("instance_group '{}': GPU {gpu} is not a device number", g.name));
        }
    }
    if total > MAX_INSTANCES {
        return Err(format!(
            "instance_group asks for {total} instances of model '{}'; at most {MAX_INSTANCES} are allowed",
            cfg.name
        ));
    }
    Ok(())
}

fn check_warmup(cfg: &ModelConfig) -> Result<(), String> {
    let rows_allowed = cfg.max_batch_size.max(1) as u32;
    for w in &cfg.model_warmup {
        if w.batch_size > rows_allowed {
            return Err(format!(
                "model_warmup '{}': batch_size {} is larger than max_batch_size {}",
                w.name, w.batch_size, cfg.max_batch_size
            ));
        }
        if w.count > MAX_WARMUP_RUNS {
            return Err(format!("model_warmup '{}': count {} is over the {MAX_WARMUP_RUNS} allowed", w.name, w.count));
        }
        let mut bytes: u64 = 0;
        for (name, input) in &w.inputs {
            if input.dims.contains(&-1) {
                return Err(format!(
                    "model_warmup '{}': warmup setting expects all variable-size dimensions are specified for input '{name}'",
                    w.name
                ));
            }
            let item = crate::tensor::element_count(&input.dims)
                .and_then(|n| n.checked_mul(DataType::from_config(input.data_type)?.size().unwrap_or(1)));
            bytes = item
                .and_then(|n| (n as u64).checked_mul(u64::from(w.batch_size.max(1))))
                .and_then(|n| bytes.checked_add(n))
                .filter(|&n| n <= MAX_WARMUP_BYTES)
                .ok_or_else(|| {
                    format!(
                        "model_warmup '{}': input '{name}' with dims {} needs more than the {MAX_WARMUP_BYTES} bytes a warm-up sample may use",
                        w.name,
                        shape_string(&input.dims)
                    )
                })?;
        }
    }
    Ok(())
}

fn validate_sequence_batching(cfg: &ModelConfig, sb: &ModelSequenceBatching) -> Result<(), String> {
    use crate::proto::inference::model_sequence_batching::{StrategyChoice, control::Kind};
    let name = &cfg.name;
    if cfg.response_cache.as_ref().is_some_and(|c| c.enable) {
        return Err(format!("model '{name}': the response cache cannot be used with sequence_batching"));
    }
    if !cfg.model_warmup.is_empty() {
        return Err(format!("model '{name}': model_warmup is not supported for sequence models by ferry"));
    }
    for ci in &sb.control_input {
        let [k] = ci.control.as_slice() else {
            return Err(format!("sequence_batching control_input '{}' must hold exactly one control", ci.name));
        };
        let kind = Kind::try_from(k.kind).map_err(|_| format!("control_input '{}' has an unknown kind", ci.name))?;
        let lists = [!k.int32_false_true.is_empty(), !k.fp32_false_true.is_empty(), !k.bool_false_true.is_empty()];
        if kind == Kind::ControlSequenceCorrid {
            let ok = matches!(
                DataType::from_config(k.data_type),
                Some(DataType::Uint64 | DataType::Int64 | DataType::Uint32 | DataType::Int32 | DataType::Bytes)
            );
            if !ok {
                return Err(format!(
                    "control_input '{}': CONTROL_SEQUENCE_CORRID needs data_type TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING",
                    ci.name
                ));
            }
        } else {
            let lens = [k.int32_false_true.len(), k.fp32_false_true.len(), k.bool_false_true.len()];
            if lists.iter().filter(|&&b| b).count() != 1 || !lens.contains(&2) {
                return Err(format!(
                    "control_input '{}': {} needs exactly one of int32_false_true, fp32_false_true or bool_false_true with 2 entries",
                    ci.name,
                    kind.as_str_name()
                ));
            }
        }
    }
    if let Some(StrategyChoice::Oldest(o)) = &sb.strategy_choice
        && let Some(p) = o.preferred_batch_size.iter().find(|&&p| p < 1 || p > cfg.max_batch_size.max(1))
    {
        return Err(format!("sequence_batching.oldest.preferred_batch_size {p} must be between 1 and max_batch_size"));
    }
    for st in &sb.state {
        if cfg.input.iter().any(|i| i.name == st.input_name) {
            return Err(format!("sequence_batching state '{}' is also listed as an input", st.input_name));
        }
    }
    Ok(())
}

fn validate_dynamic_batching(db: &ModelDynamicBatching, max: i32) -> Result<(), String> {
    if let Some(p) = db.preferred_batch_size.iter().find(|&&p| p < 1 || p > max) {
        return Err(format!("dynamic_batching.preferred_batch_size {p} must be between 1 and max_batch_size {max}"));
    }
    let levels = db.priority_levels;
    if levels > MAX_PRIORITY_LEVELS {
        return Err(format!("dynamic_batching.priority_levels {levels} is over the {MAX_PRIORITY_LEVELS} allowed"));
    }
    if levels > 0 {
        if db.default_priority_level < 1 || db.default_priority_level > levels {
            return Err(format!(
                "dynamic_batching.default_priority_level {} must be between 1 and priority_levels {levels}",
                db.default_priority_level
            ));
        }
        if let Some(k) = db.priority_queue_policy.keys().find(|&&k| k < 1 || k > levels) {
            return Err(format!(
                "dynamic_batching.priority_queue_policy key {k} must be between 1 and priority_levels {levels}"
            ));
        }
    }
    if db.preserve_ordering && levels > 1 {
        return Err("dynamic_batching.preserve_ordering allows at most 1 priority level".into());
    }
    Ok(())
}

/// The tensors a model declares as scalars (shape `[]`, or `[-1]` for a batching model) that the
/// config gives as `dims: [1]` without a reshape, as Triton's ONNX Runtime backend accepts them:
/// requests send `[1]` per item, the model sees a scalar, a scalar output is reported as `[1]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scalars {
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
}

/// Config inputs and outputs must exist in the model with the same datatype and a compatible
/// shape; every input the model needs must be in the config. Returns the scalar tensors.
pub fn check_against_model(cfg: &ModelConfig, io: &ModelIo) -> Result<Scalars, String> {
    let mut scalars = Scalars::default();
    if io.inputs.is_empty() && io.outputs.is_empty() {
        return Ok(scalars); // the backend declares nothing to compare with
    }
    let batching = cfg.max_batch_size > 0;
    for i in &cfg.input {
        let m = find(&io.inputs, &i.name, "input", cfg)?;
        // A ragged input reaches the model as one flat tensor of every request's elements.
        if i.allow_ragged_batch && m.shape.len() == 1 {
            same_datatype(&cfg.name, "input", &i.name, i.data_type, m)?;
        } else if compare(&cfg.name, "input", &i.name, i.data_type, &i.dims, i.reshape.as_ref(), m, batching)? {
            scalars.inputs.push(i.name.clone());
        }
    }
    for m in io.inputs.iter().filter(|m| !cfg.input.iter().any(|i| i.name == m.name)) {
        match cfg.batch_input.iter().find(|b| b.target_name.contains(&m.name)) {
            Some(b) => same_datatype(&cfg.name, "batch input", &m.name, b.data_type, m)?,
            None => {
                return Err(format!(
                    "model '{}': the model requires input '{}', which the configuration does not list",
                    cfg.name, m.name
                ));
            }
        }
    }
    for o in &cfg.output {
        let m = find(&io.outputs, &o.name, "output", cfg)?;
        // A scattered output's shape is the model's own (split by an input's shapes).
        if cfg.batch_output.iter().any(|b| b.target_name.contains(&o.name)) {
            same_datatype(&cfg.name, "output", &o.name, o.data_type, m)?;
        } else if compare(&cfg.name, "output", &o.name, o.data_type, &o.dims, o.reshape.as_ref(), m, batching)? {
            scalars.outputs.push(o.name.clone());
        }
    }
    Ok(scalars)
}

fn find<'a>(list: &'a [TensorInfo], name: &str, what: &str, cfg: &ModelConfig) -> Result<&'a TensorInfo, String> {
    list.iter().find(|t| t.name == name).ok_or_else(|| {
        let have: Vec<&str> = list.iter().map(|t| t.name.as_str()).collect();
        format!(
            "model '{}': configuration {what} '{name}' is not {} {what} of the model (the model's {what}s: {})",
            cfg.name,
            if what.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" },
            have.join(", ")
        )
    })
}

fn same_datatype(model: &str, what: &str, name: &str, data_type: i32, m: &TensorInfo) -> Result<(), String> {
    let config_dt = DataType::from_config(data_type);
    if m.datatype != config_dt {
        let model_dt = m.datatype.map_or("an unsupported type", |d| d.config_name());
        return Err(format!(
            "model '{model}', {what} '{name}': the configuration says {} but the model has {model_dt}",
            config_dt.map_or("TYPE_INVALID", |d| d.config_name())
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn compare(
    model: &str,
    what: &str,
    name: &str,
    data_type: i32,
    dims: &[i64],
    reshape: Option<&ModelTensorReshape>,
    m: &TensorInfo,
    batching: bool,
) -> Result<bool, String> {
    same_datatype(model, what, name, data_type, m)?;
    if batching && m.shape.first() != Some(&-1) {
        return Err(format!(
            "model '{model}', {what} '{name}': max_batch_size > 0 needs a variable first (batch) dimension, but the \
             model's shape is {}",
            shape_string(&m.shape)
        ));
    }
    let item = if batching { &m.shape[1..] } else { &m.shape[..] };
    if reshape.is_none() && dims == [1] && item.is_empty() {
        return Ok(true);
    }
    let seen = reshape.map_or(dims, |r| &r.shape[..]);
    let mut expected: Vec<i64> = if batching { vec![-1] } else { Vec::new() };
    expected.extend_from_slice(seen);
    let fits =
        expected.len() == m.shape.len() && expected.iter().zip(&m.shape).all(|(&c, &d)| c == -1 || d == -1 || c == d);
    if !fits {
        return Err(format!(
            "model '{model}', {what} '{name}': the model's shape is {} but the configuration gives {}{}",
            shape_string(&m.shape),
            shape_string(&expected),
            if batching { " (the leading -1 is the batch dimension from max_batch_size > 0)" } else { "" }
        ));
    }
    Ok(false)
}
