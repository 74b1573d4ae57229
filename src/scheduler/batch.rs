//! Runs one batch on an instance: each request's rows are copied once into the batch buffer (no
//! copy for a batch of one), outputs are split back per request as zero-copy slices.
use std::time::Instant;

use bytes::Bytes;

use super::{Job, ModelContext, Responder, ragged};
use crate::{
    backend::{BackendInput, BackendRequest, DeviceTarget, ModelInstance},
    classify::classify,
    device::DeviceBytes,
    error::{Error, Origin, Result},
    request::InferResponse,
    schema::{Schema, TensorSpec},
    stats::PhaseTimes,
    telemetry::otel,
    tensor::{DataType, Tensor, bytes_element_offsets, element_count},
    validate::{ModelTensor, OutputRequest},
};

/// A batch input: the request's own bytes, rows gathered into one 8-byte-aligned buffer, or
/// each request's piece of GPU memory (for an instance with device I/O on that GPU).
enum Buffer {
    Shared(Bytes),
    Gathered(Vec<u64>, usize),
    Device(Vec<DeviceBytes>),
}

impl Buffer {
    fn bytes(&self) -> &[u8] {
        match self {
            Buffer::Shared(b) => b,
            Buffer::Gathered(words, len) => &bytemuck::cast_slice(words)[..*len],
            Buffer::Device(_) => &[],
        }
    }

    fn device(&self) -> &[DeviceBytes] {
        match self {
            Buffer::Device(pieces) => pieces,
            _ => &[],
        }
    }
}

pub(super) fn run(instance: &mut dyn ModelInstance, ctx: &ModelContext, responder: &Responder, mut jobs: Vec<Job>) {
    let start = Instant::now();
    for job in &mut jobs {
        drop(std::mem::replace(&mut job.queue_span, tracing::Span::none()));
    }
    if instance.separate_requests() {
        return run_each(instance, ctx, responder, jobs, start);
    }
    let schema = &ctx.schema;
    let rows: usize = jobs.iter().map(|j| j.req.rows).sum();
    let wanted = wanted_outputs(&jobs);
    let assembled = match assemble(schema, &jobs, rows, instance.device_io()) {
        Ok(assembled) => assembled,
        Err(e) => {
            for job in jobs {
                responder.send(job.seq, job.reply, Err(e.clone()));
            }
            return;
        }
    };
    let inputs: Vec<BackendInput<'_>> = assembled
        .iter()
        .map(|a| BackendInput {
            name: a.name,
            datatype: a.datatype,
            shape: &a.shape,
            data: a.buffer.bytes(),
            device: a.buffer.device(),
        })
        .collect();
    let names: Vec<&str> = wanted.iter().map(|&i| schema.outputs[i].name.as_str()).collect();
    let targets = device_targets(&jobs, &wanted);
    let input_done = Instant::now();
    let compute = otel::compute_span(jobs.iter().map(|j| &j.req.span), rows);
    let result = compute
        .in_scope(|| instance.execute_device(&inputs, &names, &targets).map_err(|e| e.with_origin(Origin::Backend)));
    drop(compute);
    let infer_done = Instant::now();
    let copied = instance.copy_in_time();
    drop(targets);
    drop(inputs);
    drop(assembled);
    let (outputs, written) = match result.and_then(|done| {
        let written = done.written;
        check_outputs(ctx, &jobs, &wanted, done.outputs, rows).map(|outs| (outs, written))
    }) {
        Ok(done) => done,
        Err(e) => {
            tracing::debug!(model = %ctx.name, version = ctx.version, error = %e, "batch failed");
            for job in jobs {
                responder.send(job.seq, job.reply, Err(e.clone()));
            }
            return;
        }
    };
    let mut offset = 0;
    // Elements of each scatter source before the request (no work for models without one).
    let mut scattered = if schema.scatter_outputs.is_empty() { Vec::new() } else { vec![0usize; schema.inputs.len()] };
    let replies: Vec<_> = jobs
        .into_iter()
        .map(|job| {
            let _span = otel::response_span(&job.req.span).entered();
            let at = At { row: offset, rows, elements: &scattered };
            let response = respond(ctx, &job, (&wanted, &written), &outputs, at);
            offset += job.req.rows;
            for (i, n) in scattered.iter_mut().enumerate() {
                *n += job.req.inputs[i].as_ref().and_then(|t| element_count(&t.shape)).unwrap_or(0);
            }
            (job, response)
        })
        .collect();
    let queued: Vec<_> = replies.iter().map(|(j, _)| start.saturating_duration_since(j.enqueued)).collect();
    // A GPU instance's copy to the device is input preparation, as Triton counts it.
    let copy = copied.unwrap_or_default().min(infer_done - input_done);
    let phases = PhaseTimes {
        input: input_done - start + copy,
        infer: infer_done - input_done - copy,
        output: infer_done.elapsed(),
    };
    ctx.stats.record_execution(rows as u64, &queued, phases);
    for (job, response) in replies {
        responder.send(job.seq, job.reply, response);
    }
}

/// A batch for an instance that answers each request on its own (a Python model's
/// `execute(requests)`): no rows are gathered, and one request's error fails only that request.
fn run_each(
    instance: &mut dyn ModelInstance,
    ctx: &ModelContext,
    responder: &Responder,
    jobs: Vec<Job>,
    start: Instant,
) {
    let schema = &ctx.schema;
    let gone: Vec<_> = jobs.iter().map(|j| move || j.reply.is_closed()).collect();
    // Each request is a batch of its own: its batch inputs describe it alone.
    let generated: Vec<Result<Vec<ragged::Generated>>> = jobs
        .iter()
        .map(|j| {
            schema
                .batch_inputs
                .iter()
                .map(|b| ragged::generate(b, schema.batching(), &[j.req.inputs[b.source].as_ref()]))
                .collect()
        })
        .collect();
    let requests: Vec<BackendRequest<'_>> = jobs
        .iter()
        .zip(&gone)
        .zip(&generated)
        .map(|((j, gone), made)| BackendRequest {
            id: &j.req.id,
            parameters: &j.req.parameters,
            inputs: j
                .req
                .inputs
                .iter()
                .enumerate()
                .filter_map(|(i, t)| {
                    let t = t.as_ref()?;
                    let spec = &schema.inputs[i];
                    Some(BackendInput {
                        name: &spec.name,
                        datatype: spec.datatype,
                        shape: &t.shape,
                        data: &t.data,
                        device: t.device.as_slice(),
                    })
                })
                .chain(made.iter().flatten().zip(&schema.batch_inputs).map(|(g, b)| BackendInput {
                    name: &b.name,
                    datatype: b.datatype,
                    shape: &g.shape,
                    data: g.bytes(),
                    device: &[],
                }))
                .collect(),
            outputs: j.req.outputs.iter().map(|o| schema.outputs[o.index].name.as_str()).collect(),
            stream: j.req.stream.as_ref(),
            context: &j.req.context,
            cancelled: Some(gone),
        })
        .collect();
    let input_done = Instant::now();
    let compute = otel::compute_span(jobs.iter().map(|j| &j.req.span), jobs.len());
    let results = compute.in_scope(|| instance.execute_each(&requests));
    drop(compute);
    drop(requests);
    let infer_done = Instant::now();
    let rows: usize = jobs.iter().map(|j| j.req.rows).sum();
    let replies: Vec<_> = jobs
        .into_iter()
        .zip(results)
        .zip(generated)
        .map(|((job, result), made)| {
            let result = made.and(result);
            let response = result.map_err(|e| e.with_origin(Origin::Backend)).and_then(|answer| {
                if job.req.stream.is_some() {
                    // Its responses stream; this reply only says the request was taken.
                    return Ok(InferResponse {
                        model_name: ctx.name.clone(),
                        model_version: ctx.version,
                        id: job.req.id.clone(),
                        parameters: Default::default(),
                        outputs: Vec::new(),
                    });
                }
                let mut response = respond_one(ctx, &job, answer.outputs)?;
                response.parameters = answer.parameters;
                Ok(response)
            });
            (job, response)
        })
        .collect();
    let queued: Vec<_> = replies.iter().map(|(j, _)| start.saturating_duration_since(j.enqueued)).collect();
    let phases = PhaseTimes { input: input_done - start, infer: infer_done - input_done, output: infer_done.elapsed() };
    ctx.stats.record_execution(rows as u64, &queued, phases);
    for (job, response) in replies {
        responder.send(job.seq, job.reply, response);
    }
}

/// One request's outputs, by name, checked against the config.
fn respond_one(ctx: &ModelContext, job: &Job, mut outs: Vec<Tensor>) -> Result<InferResponse> {
    let outputs = job
        .req
        .outputs
        .iter()
        .map(|o| {
            let spec = &ctx.schema.outputs[o.index];
            let at = outs.iter().position(|t| t.name == spec.name).ok_or_else(|| {
                Error::internal(format!(
                    "model '{}' gave no output '{}' for request '{}'",
                    ctx.name, spec.name, job.req.id
                ))
            })?;
            let t = outs.swap_remove(at);
            ctx.schema.check_output(&ctx.name, o.index, &t)?;
            finish_output(ctx, job, o, t, false)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(response(ctx, job, outputs))
}

/// The model's output datatype against its config's.
fn check_datatype(ctx: &ModelContext, index: usize, t: &Tensor) -> Result<()> {
    let spec = &ctx.schema.outputs[index];
    if t.datatype == spec.datatype {
        return Ok(());
    }
    Err(Error::internal(format!(
        "model '{}' output '{}' is {} but its config says {}",
        ctx.name,
        spec.name,
        t.datatype.wire(),
        spec.datatype.wire()
    )))
}

/// One output as its request gets it: the client's shape, copied into the request's GPU region
/// unless the instance `written` it there, and reduced to classes where the request asked so.
fn finish_output(ctx: &ModelContext, job: &Job, o: &OutputRequest, mut t: Tensor, written: bool) -> Result<Tensor> {
    let spec = &ctx.schema.outputs[o.index];
    t.shape = client_shape(spec, ctx.schema.batching(), &t.shape);
    to_device(job, o.index, &mut t, written)?;
    match o.classification {
        Some(k) => classify(&t, ctx.schema.batching(), k as usize, &spec.labels),
        None => Ok(t),
    }
}

fn response(ctx: &ModelContext, job: &Job, outputs: Vec<Tensor>) -> InferResponse {
    InferResponse {
        model_name: ctx.name.clone(),
        model_version: ctx.version,
        id: job.req.id.clone(),
        parameters: Default::default(),
        outputs,
    }
}

/// Schema indices of every output some request of the batch asked for, in schema order.
fn wanted_outputs(jobs: &[Job]) -> Vec<usize> {
    let mut wanted: Vec<usize> = jobs.iter().flat_map(|j| j.req.outputs.iter().map(|o| o.index)).collect();
    wanted.sort_unstable();
    wanted.dedup();
    wanted
}

/// Each request's rows of the outputs that every request of the batch wants in GPU memory
/// (an output only some want there goes through the host, and is copied there per request).
fn device_targets<'a>(jobs: &'a [Job], wanted: &[usize]) -> Vec<DeviceTarget<'a>> {
    let mut targets = Vec::new();
    for (output, index) in wanted.iter().enumerate() {
        let all = jobs.iter().all(|j| j.req.device_outputs.iter().any(|(i, _)| i == index));
        if !all {
            continue;
        }
        let mut first_row = 0;
        for job in jobs {
            if let Some((_, to)) = job.req.device_outputs.iter().find(|(i, _)| i == index) {
                targets.push(DeviceTarget { output, first_row, rows: job.req.rows, to });
            }
            first_row += job.req.rows;
        }
    }
    targets
}

/// A request's output that it wants in GPU memory goes there: the instance wrote it already
/// (`written`), or its bytes are copied there now. The reply then carries it empty.
fn to_device(job: &Job, index: usize, t: &mut Tensor, written: bool) -> Result<()> {
    let Some((_, to)) = job.req.device_outputs.iter().find(|(i, _)| *i == index) else {
        return Ok(());
    };
    let needed = match t.datatype.size() {
        Some(size) => element_count(&t.shape).unwrap_or(0).saturating_mul(size),
        None => t.data.len(),
    };
    if needed > to.len() {
        return Err(crate::device::too_small(&t.name, to.len(), needed));
    }
    if !written {
        to.write(&t.data)?;
    }
    t.data = Bytes::new();
    Ok(())
}

/// One input of the batch as the instance gets it.
struct Assembled<'a> {
    name: &'a str,
    datatype: DataType,
    shape: Vec<i64>,
    buffer: Buffer,
}

/// The batch's inputs, then the batch inputs made for it. Pieces in GPU memory stay there when
/// every request's piece is on the instance's own GPU; otherwise they are copied into the host
/// buffer with the rest.
fn assemble<'a>(schema: &'a Schema, jobs: &[Job], rows: usize, gpu: Option<i32>) -> Result<Vec<Assembled<'a>>> {
    let first = &jobs[0].req;
    let mut assembled = Vec::with_capacity(schema.inputs.len() + schema.batch_inputs.len());
    for i in 0..schema.inputs.len() {
        let Some(head) = first.inputs[i].as_ref() else { continue };
        let pieces = || jobs.iter().filter_map(|j| j.req.inputs[i].as_ref());
        let ragged = schema.inputs[i].allow_ragged_batch;
        // A ragged input reaches the model as one flat tensor of every request's elements.
        let flat = |count: usize| vec![count as i64];
        let shape = if ragged {
            flat(pieces().filter_map(|t| element_count(&t.shape)).sum())
        } else if jobs.len() == 1 {
            head.shape.clone()
        } else {
            let mut shape = head.shape.clone();
            shape[0] = rows as i64;
            shape
        };
        let on_gpu = |t: &ModelTensor| t.device.as_ref().is_some_and(|d| Some(d.gpu()) == gpu);
        let buffer = if head.device.is_some() && pieces().all(on_gpu) {
            Buffer::Device(pieces().filter_map(|t| t.device.clone()).collect())
        } else if jobs.len() == 1 && head.device.is_none() {
            Buffer::Shared(head.data.clone())
        } else {
            let len: usize = pieces().map(ModelTensor::byte_len).sum();
            let mut words = vec![0u64; len.div_ceil(8)];
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
            let mut at = 0;
            for t in pieces() {
                let piece = &mut bytes[at..at + t.byte_len()];
                match &t.device {
                    Some(device) => device.read_into(piece)?,
                    None => piece.copy_from_slice(&t.data),
                }
                at += t.byte_len();
            }
            Buffer::Gathered(words, len)
        };
        let spec = &schema.inputs[i];
        assembled.push(Assembled { name: &spec.name, datatype: spec.datatype, shape, buffer });
    }
    for b in &schema.batch_inputs {
        let sources: Vec<_> = jobs.iter().map(|j| j.req.inputs[b.source].as_ref()).collect();
        let made = ragged::generate(b, schema.batching(), &sources)?;
        let buffer = Buffer::Gathered(made.words, made.len);
        assembled.push(Assembled { name: &b.name, datatype: b.datatype, shape: made.shape, buffer });
    }
    Ok(assembled)
}

/// Checks what the backend returned against the config, and maps them by schema index.
fn check_outputs(
    ctx: &ModelContext,
    jobs: &[Job],
    wanted: &[usize],
    outs: Vec<Tensor>,
    rows: usize,
) -> Result<Vec<Tensor>> {
    if outs.len() != wanted.len() {
        return Err(Error::internal(format!(
            "model '{}' returned {} outputs, expected {}",
            ctx.name,
            outs.len(),
            wanted.len()
        )));
    }
    for (t, &i) in outs.iter().zip(wanted) {
        check_datatype(ctx, i, t)?;
        let spec = &ctx.schema.outputs[i];
        if let Some(source) = ctx.schema.scatter_source(i) {
            let counts = ragged::element_counts(jobs.iter().map(|j| j.req.inputs[source].as_ref()));
            ragged::check_scatter(&ctx.name, &ctx.schema, i, t, &counts)?;
        } else if ctx.schema.batching() && t.shape.first().copied() != Some(rows as i64) {
            return Err(Error::internal(format!(
                "model '{}' output '{}' has shape {:?}, whose first dim should be the batch size {rows}",
                ctx.name, spec.name, t.shape
            )));
        }
    }
    Ok(outs)
}

/// Where one request's part of the batch starts: its first row of `rows`, and the elements of
/// each input the requests before it sent (for scattered outputs).
struct At<'a> {
    row: usize,
    rows: usize,
    elements: &'a [usize],
}

fn respond(
    ctx: &ModelContext,
    job: &Job,
    (wanted, written): (&[usize], &[bool]),
    outs: &[Tensor],
    at: At<'_>,
) -> Result<InferResponse> {
    let outputs = job
        .req
        .outputs
        .iter()
        .map(|o| {
            let index = wanted.binary_search(&o.index).expect("every requested output was run");
            let t = &outs[index];
            let scatter = ctx.schema.scatter_source(o.index).map(|s| (s, job.req.inputs[s].as_ref()));
            let part = if let Some((source, input)) = scatter {
                let shape = input.map_or(&[0][..], |t| &t.shape);
                let count = element_count(shape).unwrap_or(0);
                ragged::scatter(t, at.elements[source], count, shape)?
            } else if ctx.schema.batching() && at.rows != job.req.rows {
                slice_rows(t, at.row, job.req.rows, at.rows)?
            } else {
                t.clone()
            };
            finish_output(ctx, job, o, part, written.get(index).copied().unwrap_or(false))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(response(ctx, job, outputs))
}

/// Rows `[offset, offset + n)` of a batched output, without copying.
fn slice_rows(t: &Tensor, offset: usize, n: usize, rows: usize) -> Result<Tensor> {
    let range = if t.datatype == DataType::Bytes {
        let offsets = bytes_element_offsets(&t.data)?;
        let per_row = (offsets.len() - 1) / rows.max(1);
        offsets[offset * per_row]..offsets[(offset + n) * per_row]
    } else {
        let per_row = t.data.len() / rows.max(1);
        offset * per_row..(offset + n) * per_row
    };
    let mut shape = t.shape.clone();
    shape[0] = n as i64;
    Ok(Tensor { name: t.name.clone(), datatype: t.datatype, shape, data: t.data.slice(range) })
}

/// An output with a config `reshape` goes back to clients in its `dims` shape.
fn client_shape(spec: &TensorSpec, batching: bool, model_shape: &[i64]) -> Vec<i64> {
    if spec.reshape.is_none() {
        return model_shape.to_vec();
    }
    let batch: Vec<i64> = if batching { model_shape.first().copied().into_iter().collect() } else { Vec::new() };
    let mut shape = batch.clone();
    shape.extend_from_slice(&spec.dims);
    let unknown = spec.dims.iter().filter(|&&d| d == -1).count();
    if unknown == 0 {
        return shape;
    }
    let total = element_count(model_shape).unwrap_or(0) as i64;
    let known: i64 = shape.iter().filter(|&&d| d != -1).product();
    if unknown == 1 && known > 0 {
        shape.iter_mut().filter(|d| **d == -1).for_each(|d| *d = total / known);
        shape
    } else {
        model_shape.to_vec()
    }
}
