//! The sequence batcher: requests that carry `sequence_id` / `sequence_start` / `sequence_end`.
//! A sequence owns a slot from its START to its END (or until it is idle for
//! `max_sequence_idle_microseconds`); new sequences wait while every slot is taken (slots: batch
//! size × instances for `direct`, `max_candidate_sequences` for `oldest`). One request of a
//! sequence runs at a time, in arrival order, so requests of different sequences meet in the
//! version's batcher (one per sequence per batch). The slot owns the sequence's implicit state
//! (`state { input_name output_name ... }`): handed to the model with each request, replaced by
//! the model's output — backends stay stateless. Control inputs (START, END, READY, CORRID) are
//! made here per request.
use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;

use crate::{
    error::{Error, Result},
    proto::inference::{
        ModelConfig, ModelInput, ModelOutput, ModelSequenceBatching,
        model_config::SchedulingChoice,
        model_sequence_batching::{StrategyChoice, control::Kind, initial_state::StateData},
    },
    request::{InferResponse, ParamValue},
    schema::Schema,
    tensor::DataType,
    validate::{ModelTensor, OutputRequest, ValidatedRequest},
};

/// A correlation id: an integer or a string, as clients send it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SeqId {
    Int(u64),
    Str(String),
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SeqId::Int(n) => write!(f, "{n}"),
            SeqId::Str(s) => write!(f, "'{s}'"),
        }
    }
}

/// One implicit state tensor: where it goes in and comes out, and its value at START.
#[derive(Debug, Clone)]
pub struct StateSpec {
    /// Indices in the scheduler's schema.
    pub input: usize,
    pub output: usize,
    pub output_name: String,
    /// The shape the model sees (batch dim included when the model batches).
    pub shape: Vec<i64>,
    pub initial: Bytes,
}

/// One control input: its index in the scheduler's schema, what it says, and how.
#[derive(Debug, Clone)]
pub struct ControlSpec {
    pub input: usize,
    pub kind: Kind,
    pub datatype: DataType,
    /// The false and true values (START, END, READY), encoded in `datatype`.
    pub values: [Bytes; 2],
    pub shape: Vec<i64>,
}

/// What a sequence version needs, decided at load.
#[derive(Debug, Clone)]
pub struct SequencePlan {
    pub model: String,
    pub slots: usize,
    pub idle: Duration,
    pub states: Vec<StateSpec>,
    pub controls: Vec<ControlSpec>,
    /// Outputs of the scheduler's schema clients never see (state outputs not in `output`).
    pub client_outputs: usize,
    /// The CORRID control's datatype, when the model has one (a string id needs STRING).
    pub corrid: Option<DataType>,
    /// The model batches: state and control tensors carry a leading batch dim of 1.
    pub batching: bool,
    /// `iterative_sequence`: a request with no correlation id is a sequence of its own (one
    /// request, rescheduled by the model until done), as Triton takes it.
    pub iterative: bool,
}

struct Seq {
    states: Vec<Bytes>,
    last: Instant,
    busy: bool,
    /// A request of it was cancelled while it waited: the sequence ends once the one running is done.
    cancelled: bool,
}

/// The requests of one sequence waiting their turn, in arrival order. Cancelling one cancels
/// the sequence, as Triton does: every request of it still waiting ends CANCELLED.
#[derive(Default)]
struct Line {
    tickets: VecDeque<u64>,
    cancelled: Arc<AtomicBool>,
}

#[derive(Default)]
struct Inner {
    active: BTreeMap<SeqId, Seq>,
    /// Each sequence with requests waiting (for a slot, for START, for the one running).
    lines: BTreeMap<SeqId, Line>,
    /// Sequences waiting for a slot (their START requests), oldest first.
    waiting: VecDeque<u64>,
    next_ticket: u64,
}

impl Inner {
    fn ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.next_ticket
    }
}

pub struct Sequences {
    plan: SequencePlan,
    inner: Mutex<Inner>,
    /// Rung when a slot frees or a sequence's request finishes.
    changed: tokio::sync::Notify,
}

/// Counts for the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceCounts {
    pub active: usize,
    pub waiting: usize,
    pub slots: usize,
}

/// The sequence flags of a request.
struct Flags {
    id: SeqId,
    start: bool,
    end: bool,
}

fn flags(model: &str, req: &ValidatedRequest, iterative: bool) -> Result<Flags> {
    let p = &req.parameters;
    let id = match p.get("sequence_id") {
        Some(ParamValue::String(s)) if !s.is_empty() => SeqId::Str(s.clone()),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => SeqId::Int(n),
            _ => SeqId::Int(0),
        },
        None => SeqId::Int(0),
    };
    if id == SeqId::Int(0) && iterative {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Ok(Flags { id: SeqId::Str(format!("\u{0}ferry-iterative-{n}")), start: true, end: true });
    }
    if id == SeqId::Int(0) {
        return Err(Error::invalid(format!(
            "inference request to model '{model}' must specify a non-zero or non-empty correlation ID"
        )));
    }
    let flag = |k: &str| matches!(p.get(k), Some(ParamValue::Bool(true)));
    Ok(Flags { id, start: flag("sequence_start"), end: flag("sequence_end") })
}

impl Sequences {
    pub fn new(plan: SequencePlan) -> Arc<Sequences> {
        Arc::new(Sequences { plan, inner: Mutex::default(), changed: tokio::sync::Notify::new() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn counts(&self) -> SequenceCounts {
        let inner = self.lock();
        SequenceCounts { active: inner.active.len(), waiting: inner.waiting.len(), slots: self.plan.slots }
    }

    /// Releases sequences idle longer than the limit (their next request is an error).
    fn sweep(&self, inner: &mut Inner, now: Instant) {
        let idle = self.plan.idle;
        let before = inner.active.len();
        inner.active.retain(|_, s| s.busy || now.duration_since(s.last) < idle);
        if inner.active.len() < before {
            self.changed.notify_waiters();
        }
    }

    /// Runs one request of a sequence through `submit` (the version's scheduler).
    pub async fn run<F, Fut>(&self, mut req: ValidatedRequest, submit: F) -> Result<InferResponse>
    where
        F: FnOnce(ValidatedRequest) -> Fut,
        Fut: Future<Output = Result<InferResponse>>,
    {
        let model = &self.plan.model;
        let f = flags(model, &req, self.plan.iterative)?;
        if req.rows != 1 {
            return Err(Error::invalid(format!(
                "inference request to model '{model}' must specify batch-size 1 due to requirements of sequence batcher"
            )));
        }
        if let (SeqId::Str(_), Some(dt)) = (&f.id, self.plan.corrid)
            && dt != DataType::Bytes
        {
            return Err(Error::invalid(format!(
                "sequence ID {} for model '{model}' is a string, but the model's CORRID control input is {}",
                f.id,
                dt.wire()
            )));
        }
        if let (SeqId::Int(n), Some(dt @ (DataType::Int32 | DataType::Uint32))) = (&f.id, self.plan.corrid) {
            let most = if dt == DataType::Int32 { i32::MAX as u64 } else { u64::from(u32::MAX) };
            if *n > most {
                return Err(Error::invalid(format!(
                    "sequence ID {n} for model '{model}' does not fit its CORRID control input ({}, at most {most})",
                    dt.wire()
                )));
            }
        }
        let states = self.acquire(&f).await?;
        // From here the sequence is busy: a caller that goes away (its future dropped) frees it.
        let mut busy = Busy { seqs: self, id: Some(&f.id) };
        self.fill(&mut req, &f, states);
        let wanted = req.outputs.len();
        for s in &self.plan.states {
            if !req.outputs.iter().any(|o| o.index == s.output) {
                req.outputs.push(OutputRequest { index: s.output, classification: None });
            }
        }
        let outcome = submit(req).await;
        busy.id = None;
        let mut inner = self.lock();
        let done = match (&outcome, inner.active.get_mut(&f.id)) {
            (Ok(resp), Some(seq)) => {
                for (i, s) in self.plan.states.iter().enumerate() {
                    if let Some(t) = resp.outputs.iter().find(|t| t.name == s.output_name) {
                        seq.states[i] = t.data.clone();
                    }
                }
                seq.busy = false;
                seq.last = Instant::now();
                f.end || seq.cancelled
            }
            (Err(_), Some(seq)) => {
                seq.busy = false;
                seq.last = Instant::now();
                f.end || seq.cancelled
            }
            (_, None) => false,
        };
        if done {
            inner.active.remove(&f.id);
        }
        drop(inner);
        self.changed.notify_waiters();
        outcome.map(|mut resp| {
            resp.outputs.truncate(wanted);
            resp
        })
    }

    /// The sequence's states, once it may run its next request: requests of a sequence take
    /// their turn in arrival order (a request behind a START that waits for a slot waits too);
    /// START takes a slot (waiting while all are taken), any other request needs an active
    /// sequence, and a sequence runs one request at a time.
    async fn acquire(&self, f: &Flags) -> Result<Vec<Bytes>> {
        let model = &self.plan.model;
        // Dropped while it waits (its caller went away), it cancels its sequence.
        let mut turn = {
            let mut inner = self.lock();
            let ticket = inner.ticket();
            let line = inner.lines.entry(f.id.clone()).or_default();
            line.tickets.push_back(ticket);
            Turn { seqs: self, id: &f.id, ticket, cancelled: Arc::clone(&line.cancelled), slot: None, over: false }
        };
        loop {
            let notified = self.changed.notified();
            {
                let mut inner = self.lock();
                self.sweep(&mut inner, Instant::now());
                if turn.cancelled.load(Ordering::Acquire) {
                    turn.leave(&mut inner);
                    return Err(Error::new(
                        crate::error::ErrorKind::Cancelled,
                        format!("request cancelled: a request of sequence {} to model '{model}' was cancelled", f.id),
                    )
                    .with_origin(crate::error::Origin::Cancelled));
                }
                let first = inner.lines.get(&f.id).and_then(|l| l.tickets.front()) == Some(&turn.ticket);
                let outcome = if !first {
                    None
                } else {
                    match inner.active.get_mut(&f.id) {
                        Some(_) if f.start => Some(Err(Error::invalid(format!(
                            "inference request for sequence {} to model '{model}' specifies the START flag, but the sequence is already active; end it first (sequence_end)",
                            f.id
                        )))),
                        Some(seq) if !seq.busy => {
                            seq.busy = true;
                            Some(Ok(seq.states.clone()))
                        }
                        Some(_) => None,
                        None if !f.start => Some(Err(Error::invalid(format!(
                            "inference request for sequence {} to model '{model}' must specify the START flag on the first request of the sequence",
                            f.id
                        )))),
                        None => {
                            let t = match turn.slot {
                                Some(t) => t,
                                None => {
                                    let t = inner.ticket();
                                    inner.waiting.push_back(t);
                                    *turn.slot.insert(t)
                                }
                            };
                            (inner.active.len() < self.plan.slots && inner.waiting.front() == Some(&t)).then(|| {
                                let states: Vec<Bytes> = self.plan.states.iter().map(|s| s.initial.clone()).collect();
                                let seq =
                                    Seq { states: states.clone(), last: Instant::now(), busy: true, cancelled: false };
                                inner.active.insert(f.id.clone(), seq);
                                Ok(states)
                            })
                        }
                    }
                };
                if let Some(outcome) = outcome {
                    turn.leave(&mut inner);
                    drop(inner);
                    self.changed.notify_waiters();
                    return outcome;
                }
            }
            // Waiting (a slot, or the sequence's previous request): woken by changes, and now and
            // then to release idle sequences.
            let _ = tokio::time::timeout(self.plan.idle.max(Duration::from_millis(10)), notified).await;
        }
    }

    /// Adds the state and control tensors to the request, in the scheduler's input order.
    fn fill(&self, req: &mut ValidatedRequest, f: &Flags, states: Vec<Bytes>) {
        let total = self.plan.states.len() + self.plan.controls.len();
        let first = req.inputs.len();
        req.inputs.resize(first + total, None);
        for (s, data) in self.plan.states.iter().zip(states) {
            req.inputs[s.input] = Some(ModelTensor::host(s.shape.clone(), data));
        }
        for c in &self.plan.controls {
            let data = match c.kind {
                Kind::ControlSequenceStart => c.values[usize::from(f.start)].clone(),
                Kind::ControlSequenceEnd => c.values[usize::from(f.end)].clone(),
                Kind::ControlSequenceReady => c.values[1].clone(),
                Kind::ControlSequenceCorrid => corrid_bytes(&f.id, c.datatype),
            };
            req.inputs[c.input] = Some(ModelTensor::host(c.shape.clone(), data));
        }
        let skip = usize::from(self.plan.batching);
        for t in req.inputs[first..].iter().flatten() {
            req.batch_key.extend_from_slice(&t.shape[skip.min(t.shape.len())..]);
            req.batch_key.push(-3);
        }
    }
}

/// A request's turn in its sequence's line (and its START's place in the line for a slot);
/// dropped while it waits, its sequence is cancelled: the line goes (every request in it ends
/// CANCELLED), and the sequence ends now, or once its running request is done.
struct Turn<'a> {
    seqs: &'a Sequences,
    id: &'a SeqId,
    ticket: u64,
    cancelled: Arc<AtomicBool>,
    slot: Option<u64>,
    over: bool,
}

impl Turn<'_> {
    /// Its wait is over (it runs, or it was answered): it leaves both lines.
    fn leave(&mut self, inner: &mut Inner) {
        self.over = true;
        if let Some(t) = self.slot.take()
            && let Some(at) = inner.waiting.iter().position(|&w| w == t)
        {
            inner.waiting.remove(at);
        }
        let Some(line) = inner.lines.get_mut(self.id) else { return };
        if !Arc::ptr_eq(&line.cancelled, &self.cancelled) {
            return;
        }
        line.tickets.retain(|&t| t != self.ticket);
        if line.tickets.is_empty() {
            inner.lines.remove(self.id);
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if self.over {
            return;
        }
        let mut inner = self.seqs.lock();
        self.leave(&mut inner);
        self.cancelled.store(true, Ordering::Release);
        if inner.lines.get(self.id).is_some_and(|l| Arc::ptr_eq(&l.cancelled, &self.cancelled)) {
            inner.lines.remove(self.id);
        }
        match inner.active.get_mut(self.id) {
            Some(seq) if seq.busy => seq.cancelled = true,
            Some(_) => {
                inner.active.remove(self.id);
            }
            None => {}
        }
        drop(inner);
        self.seqs.changed.notify_waiters();
    }
}

/// A sequence running a request; dropped before the reply (its caller went away), the sequence
/// is free again with the state it had, and its idle time counts from now.
struct Busy<'a> {
    seqs: &'a Sequences,
    id: Option<&'a SeqId>,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut inner = self.seqs.lock();
        if let Some(seq) = inner.active.get_mut(id) {
            seq.busy = false;
            seq.last = Instant::now();
            if seq.cancelled {
                inner.active.remove(id);
            }
        }
        drop(inner);
        self.seqs.changed.notify_waiters();
    }
}

fn corrid_bytes(id: &SeqId, dt: DataType) -> Bytes {
    match (id, dt) {
        (SeqId::Str(s), _) => {
            let mut out = Vec::with_capacity(4 + s.len());
            crate::tensor::push_bytes_element(&mut out, s.as_bytes());
            Bytes::from(out)
        }
        (SeqId::Int(n), DataType::Int32 | DataType::Uint32) => Bytes::copy_from_slice(&(*n as u32).to_le_bytes()),
        (SeqId::Int(n), DataType::Bytes) => {
            let mut out = Vec::new();
            crate::tensor::push_bytes_element(&mut out, n.to_string().as_bytes());
            Bytes::from(out)
        }
        (SeqId::Int(n), _) => Bytes::copy_from_slice(&n.to_le_bytes()),
    }
}

fn sequence_config(config: &ModelConfig) -> Option<&ModelSequenceBatching> {
    match &config.scheduling_choice {
        Some(SchedulingChoice::SequenceBatching(sb)) => Some(sb),
        _ => None,
    }
}

/// The config as the model sees it: the state inputs and control inputs after the config's
/// inputs, and the state outputs the config does not list after its outputs.
pub fn model_facing(config: &ModelConfig) -> ModelConfig {
    let mut c = config.clone();
    let Some(sb) = sequence_config(config) else { return c };
    for st in &sb.state {
        c.input.push(ModelInput {
            name: st.input_name.clone(),
            data_type: st.data_type,
            dims: st.dims.clone(),
            ..Default::default()
        });
    }
    for ci in &sb.control_input {
        let data_type = ci.control.first().map_or(0, |k| control_type(k).config());
        c.input.push(ModelInput { name: ci.name.clone(), data_type, dims: vec![1], ..Default::default() });
    }
    for st in &sb.state {
        if !c.output.iter().any(|o| o.name == st.output_name) {
            c.output.push(ModelOutput {
                name: st.output_name.clone(),
                data_type: st.data_type,
                dims: st.dims.clone(),
                ..Default::default()
            });
        }
    }
    c
}

fn control_type(k: &crate::proto::inference::model_sequence_batching::Control) -> DataType {
    if !k.int32_false_true.is_empty() {
        DataType::Int32
    } else if !k.fp32_false_true.is_empty() {
        DataType::Fp32
    } else if !k.bool_false_true.is_empty() {
        DataType::Bool
    } else {
        DataType::from_config(k.data_type).unwrap_or(DataType::Uint64)
    }
}

/// Most bytes one implicit state may hold, and all the states of every sequence slot together
/// (each sequence that runs holds its own copy).
pub const MAX_STATE_BYTES: usize = 1 << 30;
pub const MAX_STATES_BYTES: usize = 4 << 30;
/// Most sequences one version may hold at once.
pub const MAX_SLOTS: usize = 1 << 20;

/// Reads a file of the model folder (at most the given bytes).
pub type ReadFile<'a> = dyn Fn(&str, u64) -> std::result::Result<Vec<u8>, String> + 'a;

/// The plan of a sequence version. `internal` is the schema of `model_facing(config)`;
/// `read(file, bytes)` reads an initial-state data file of the model folder.
pub fn plan(
    config: &ModelConfig,
    internal: &Schema,
    client_outputs: usize,
    instances: usize,
    read: &ReadFile<'_>,
) -> std::result::Result<Option<SequencePlan>, String> {
    let Some(sb) = sequence_config(config) else { return Ok(None) };
    let batching = internal.batching();
    let with_batch = |dims: &[i64]| {
        let mut s = if batching { vec![1] } else { Vec::new() };
        s.extend_from_slice(dims);
        s
    };
    let mut states = Vec::new();
    for st in &sb.state {
        let at = |what: &str| format!("sequence_batching state '{}': {what}", st.input_name);
        let dt = DataType::from_config(st.data_type).ok_or_else(|| at("no valid data_type"))?;
        if st.dims.iter().any(|&d| d < 1) {
            return Err(at("dims must be fixed (every dimension >= 1)"));
        }
        let count = crate::tensor::element_count(&st.dims).ok_or_else(|| at("dims are too large"))?;
        let bytes = count
            .checked_mul(dt.size().ok_or_else(|| at("BYTES states are not supported"))?)
            .filter(|&b| b <= MAX_STATE_BYTES)
            .ok_or_else(|| at(&format!("dims {:?} hold more than the {MAX_STATE_BYTES} bytes a state may", st.dims)))?;
        let initial = match st.initial_state.first().and_then(|i| i.state_data.as_ref()) {
            Some(StateData::DataFile(file)) => {
                let data = read(&format!("initial_state/{file}"), bytes as u64).map_err(|e| at(&e))?;
                if data.len() != bytes {
                    return Err(at(&format!(
                        "initial_state '{file}' holds {} bytes, the state needs {bytes}",
                        data.len()
                    )));
                }
                Bytes::from(data)
            }
            _ => Bytes::from(vec![0u8; bytes]),
        };
        let input = internal.input_index(&st.input_name).ok_or_else(|| at("no input"))?;
        let output = internal.output_index(&st.output_name).ok_or_else(|| at("no output"))?;
        states.push(StateSpec {
            input,
            output,
            output_name: st.output_name.clone(),
            shape: with_batch(&st.dims),
            initial,
        });
    }
    let mut controls = Vec::new();
    let mut corrid = None;
    for ci in &sb.control_input {
        let Some(k) = ci.control.first() else { continue };
        let kind = Kind::try_from(k.kind).unwrap_or(Kind::ControlSequenceStart);
        let datatype = control_type(k);
        let values: [Bytes; 2] = if !k.int32_false_true.is_empty() {
            [0, 1]
                .map(|i| Bytes::copy_from_slice(&k.int32_false_true.get(i).copied().unwrap_or(i as i32).to_le_bytes()))
        } else if !k.fp32_false_true.is_empty() {
            [0, 1].map(|i| Bytes::copy_from_slice(&k.fp32_false_true.get(i).copied().unwrap_or(i as f32).to_le_bytes()))
        } else {
            [0, 1].map(|i| Bytes::copy_from_slice(&[u8::from(k.bool_false_true.get(i).copied().unwrap_or(i == 1))]))
        };
        if kind == Kind::ControlSequenceCorrid {
            corrid = Some(datatype);
        }
        let input = internal.input_index(&ci.name).ok_or_else(|| format!("control input '{}' is missing", ci.name))?;
        controls.push(ControlSpec { input, kind, datatype, values, shape: with_batch(&[1]) });
    }
    let per_instance = internal.max_batch_size.max(1);
    let slots = match &sb.strategy_choice {
        Some(StrategyChoice::Oldest(o)) if o.max_candidate_sequences > 0 => o.max_candidate_sequences as usize,
        Some(StrategyChoice::Oldest(_)) => per_instance,
        _ => per_instance.saturating_mul(instances.max(1)),
    };
    if slots > MAX_SLOTS {
        return Err(format!(
            "sequence_batching: {slots} sequence slots (max_candidate_sequences, or max_batch_size x instances) are \
             over the {MAX_SLOTS} allowed"
        ));
    }
    let per_sequence: usize = states.iter().map(|s| s.initial.len()).sum();
    if per_sequence.saturating_mul(slots) > MAX_STATES_BYTES {
        return Err(format!(
            "sequence_batching: {slots} sequence slots x {per_sequence} bytes of state each is over the \
             {MAX_STATES_BYTES} bytes the states of one version may hold"
        ));
    }
    let idle = match sb.max_sequence_idle_microseconds {
        0 => Duration::from_secs(1),
        us => Duration::from_micros(us),
    };
    Ok(Some(SequencePlan {
        model: config.name.clone(),
        slots,
        idle,
        states,
        controls,
        client_outputs,
        corrid,
        batching,
        iterative: sb.iterative_sequence,
    }))
}

/// The dynamic batching a sequence version's scheduler does (one request per sequence per
/// batch): the strategy's queue delay and preferred sizes.
pub fn batching(config: &ModelConfig) -> Option<crate::proto::inference::ModelDynamicBatching> {
    let sb = sequence_config(config)?;
    let mut db = crate::proto::inference::ModelDynamicBatching::default();
    match &sb.strategy_choice {
        Some(StrategyChoice::Oldest(o)) => {
            db.max_queue_delay_microseconds = o.max_queue_delay_microseconds;
            db.preferred_batch_size = o.preferred_batch_size.clone();
            db.preserve_ordering = o.preserve_ordering;
        }
        Some(StrategyChoice::Direct(d)) => db.max_queue_delay_microseconds = d.max_queue_delay_microseconds,
        None => {}
    }
    Some(db)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use tokio::sync::oneshot;

    fn seqs() -> Arc<Sequences> {
        Sequences::new(SequencePlan {
            model: "m".into(),
            slots: 1,
            idle: Duration::from_secs(60),
            states: vec![],
            controls: vec![],
            client_outputs: 0,
            corrid: None,
            batching: false,
            iterative: false,
        })
    }

    fn req(id: u64, start: bool, end: bool) -> ValidatedRequest {
        let mut parameters = crate::request::Parameters::new();
        parameters.insert("sequence_id".into(), ParamValue::Uint(id));
        parameters.insert("sequence_start".into(), ParamValue::Bool(start));
        parameters.insert("sequence_end".into(), ParamValue::Bool(end));
        ValidatedRequest {
            id: String::new(),
            parameters,
            rows: 1,
            inputs: vec![],
            outputs: vec![],
            batch_key: vec![],
            priority: 0,
            timeout_us: None,
            span: tracing::Span::none(),
            stream: None,
            device_outputs: vec![],
            context: Default::default(),
        }
    }

    fn answer() -> Result<InferResponse> {
        Ok(InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: String::new(),
            parameters: Default::default(),
            outputs: vec![],
        })
    }

    /// Runs a request whose execution ends when `release` is sent; reports `tag` once it runs.
    fn spawn(
        s: &Arc<Sequences>,
        r: ValidatedRequest,
        ran: tokio::sync::mpsc::UnboundedSender<u32>,
        tag: u32,
    ) -> (tokio::task::JoinHandle<Result<InferResponse>>, oneshot::Sender<()>) {
        let (release, wait) = oneshot::channel::<()>();
        let s = Arc::clone(s);
        let task = tokio::spawn(async move {
            s.run(r, |_| async move {
                let _ = ran.send(tag);
                let _ = wait.await;
                answer()
            })
            .await
        });
        (task, release)
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn requests_behind_a_start_that_waits_for_a_slot_wait_too_and_run_in_order() {
        let s = seqs();
        let (tx, mut ran) = tokio::sync::mpsc::unbounded_channel();
        let (first, release1) = spawn(&s, req(1, true, true), tx.clone(), 1);
        settle().await;
        let (start2, release2) = spawn(&s, req(2, true, false), tx.clone(), 2);
        settle().await;
        let (next2, release3) = spawn(&s, req(2, false, false), tx.clone(), 3);
        let (last2, release4) = spawn(&s, req(2, false, true), tx.clone(), 4);
        settle().await;
        assert_eq!(s.counts().waiting, 1);
        assert!(!next2.is_finished(), "answered early: it must wait behind its START");
        release1.send(()).unwrap();
        first.await.unwrap().unwrap();
        for release in [release2, release3, release4] {
            settle().await;
            release.send(()).unwrap();
        }
        for task in [start2, next2, last2] {
            task.await.unwrap().unwrap();
        }
        let order: Vec<u32> = std::iter::from_fn(|| ran.try_recv().ok()).collect();
        assert_eq!(order, vec![1, 2, 3, 4]);
        assert_eq!(s.counts().active, 0);
    }

    #[tokio::test]
    async fn cancelling_a_waiting_request_cancels_its_whole_sequence() {
        let s = seqs();
        let (tx, _ran) = tokio::sync::mpsc::unbounded_channel();
        let (running, release) = spawn(&s, req(1, true, false), tx.clone(), 1);
        settle().await;
        let (queued_a, _ra) = spawn(&s, req(1, false, false), tx.clone(), 2);
        let (queued_b, _rb) = spawn(&s, req(1, false, false), tx.clone(), 3);
        settle().await;
        queued_a.abort();
        let err = queued_b.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
        // The running request finishes; then the sequence is gone and its slot free.
        release.send(()).unwrap();
        running.await.unwrap().unwrap();
        assert_eq!(s.counts().active, 0);
        let err = s.run(req(1, false, true), |_| async { answer() }).await.unwrap_err();
        assert!(err.message().contains("must specify the START flag"), "{err}");
        s.run(req(3, true, true), |_| async { answer() }).await.unwrap();
    }

    #[tokio::test]
    async fn cancelling_a_backlogged_start_cancels_the_requests_behind_it() {
        let s = seqs();
        let (tx, _ran) = tokio::sync::mpsc::unbounded_channel();
        let (holder, release) = spawn(&s, req(1, true, true), tx.clone(), 1);
        settle().await;
        let (start2, _r2) = spawn(&s, req(2, true, false), tx.clone(), 2);
        settle().await;
        let (next2, _r3) = spawn(&s, req(2, false, true), tx.clone(), 3);
        settle().await;
        start2.abort();
        let err = next2.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
        assert_eq!(s.counts().waiting, 0);
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();
        s.run(req(4, true, true), |_| async { answer() }).await.unwrap();
    }
}
