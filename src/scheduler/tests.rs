use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use super::*;
use crate::{
    backend::{BackendInput, ModelInstance},
    schema::{Schema, TensorSpec},
    tensor::{DataType, Tensor},
    validate::{ModelTensor, OutputRequest},
};

/// Doubles every INT32 of its one input, after an optional pause (to let a queue build up).
struct Doubler {
    pause: Duration,
}

impl ModelInstance for Doubler {
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        std::thread::sleep(self.pause);
        let data: Vec<u8> = inputs[0]
            .data
            .chunks_exact(4)
            .flat_map(|c| (i32::from_le_bytes(c.try_into().unwrap()) * 2).to_le_bytes())
            .collect();
        Ok(vec![Tensor {
            name: outputs[0].to_string(),
            datatype: DataType::Int32,
            shape: inputs[0].shape.to_vec(),
            data: Bytes::from(data),
        }])
    }
}

fn spec(name: &str) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        datatype: DataType::Int32,
        dims: vec![2],
        reshape: None,
        optional: false,
        allow_ragged_batch: false,
        labels: Arc::default(),
    }
}

fn scheduler(batching: BatchPolicy, instances: usize, pause: Duration) -> (Scheduler, Arc<Stats>) {
    let policy = Policy { batching, queue: QueuePolicy::new(None), preserve_ordering: false };
    let schema =
        Arc::new(Schema { max_batch_size: 8, inputs: vec![spec("x")], outputs: vec![spec("y")], ..Default::default() });
    let stats = Arc::new(Stats::default());
    let ctx = ModelContext { name: "m".into(), version: 1, schema, stats: Arc::clone(&stats) };
    let instances: Vec<Box<dyn ModelInstance>> =
        (0..instances).map(|_| Box::new(Doubler { pause }) as Box<dyn ModelInstance>).collect();
    (Scheduler::start(ctx, policy, instances, None, Vec::new()).unwrap(), stats)
}

/// Dynamic batching up to 8 rows with a queue delay of `max_delay`.
fn delayed(max_delay: Duration) -> BatchPolicy {
    BatchPolicy { max_batch_size: 8, dynamic: true, preferred: vec![], max_delay, adaptive: false }
}

fn request(v: i32) -> ValidatedRequest {
    let data: Vec<u8> = [v, v + 1].iter().flat_map(|x| x.to_le_bytes()).collect();
    ValidatedRequest {
        id: v.to_string(),
        parameters: Default::default(),
        rows: 1,
        inputs: vec![Some(ModelTensor::host(vec![1, 2], Bytes::from(data)))],
        outputs: vec![OutputRequest { index: 0, classification: None }],
        batch_key: vec![2],
        priority: 0,
        timeout_us: None,
        span: tracing::Span::none(),
        stream: None,
        device_outputs: Vec::new(),
        context: Default::default(),
    }
}

fn values(t: &Tensor) -> Vec<i32> {
    t.data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[tokio::test]
async fn batches_concurrent_requests_and_answers_each() {
    let policy = delayed(Duration::from_millis(50));
    let (s, stats) = scheduler(policy, 1, Duration::from_millis(20));
    let replies: Vec<_> = (0..16).map(|v| s.submit(request(v)).ok().unwrap()).collect();
    for (v, reply) in replies.into_iter().enumerate() {
        let resp = reply.await.unwrap().unwrap();
        let v = v as i32;
        assert_eq!(resp.id, v.to_string());
        assert_eq!(resp.outputs[0].shape, vec![1, 2]);
        assert_eq!(values(&resp.outputs[0]), vec![2 * v, 2 * v + 2]);
    }
    let snap = stats.snapshot();
    assert_eq!(snap.inference_count, 16);
    assert!(snap.execution_count <= 4, "16 queued requests ran in {} executions", snap.execution_count);
    assert!(snap.batches.keys().all(|&b| b <= 8));
}

#[tokio::test]
async fn without_dynamic_batching_requests_run_alone() {
    let (s, stats) = scheduler(BatchPolicy::new(8, None), 2, Duration::ZERO);
    let replies: Vec<_> = (0..6).map(|v| s.submit(request(v)).ok().unwrap()).collect();
    for reply in replies {
        reply.await.unwrap().unwrap();
    }
    let snap = stats.snapshot();
    assert_eq!(snap.execution_count, 6);
    assert_eq!(snap.batches.keys().copied().collect::<Vec<_>>(), vec![1]);
}

#[tokio::test]
async fn stop_drains_the_queue_then_refuses() {
    let policy = delayed(Duration::from_secs(60));
    let (s, _) = scheduler(policy, 1, Duration::ZERO);
    let reply = s.submit(request(1)).ok().unwrap();
    s.stop();
    assert_eq!(values(&reply.await.unwrap().unwrap().outputs[0]), vec![2, 4]);
    assert!(s.submit(request(2)).is_err());
    s.join();
}

#[tokio::test]
async fn abandoned_requests_cost_no_compute() {
    let policy = delayed(Duration::from_millis(30));
    let (s, stats) = scheduler(policy, 1, Duration::ZERO);
    drop(s.submit(request(1)).ok().unwrap());
    let kept = s.submit(request(2)).ok().unwrap();
    kept.await.unwrap().unwrap();
    assert_eq!(stats.snapshot().inference_count, 1);
}

/// Pauses as many milliseconds as the first element of its input, then doubles it.
struct Sleeper;

impl ModelInstance for Sleeper {
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        let ms = i32::from_le_bytes(inputs[0].data[..4].try_into().unwrap());
        std::thread::sleep(Duration::from_millis(ms as u64));
        Doubler { pause: Duration::ZERO }.execute(inputs, outputs)
    }
}

fn scheduler_with(policy: Policy, instances: Vec<Box<dyn ModelInstance>>) -> Scheduler {
    let schema =
        Arc::new(Schema { max_batch_size: 8, inputs: vec![spec("x")], outputs: vec![spec("y")], ..Default::default() });
    let ctx = ModelContext { name: "m".into(), version: 1, schema, stats: Arc::new(Stats::default()) };
    Scheduler::start(ctx, policy, instances, None, Vec::new()).unwrap()
}

#[tokio::test]
async fn preserve_ordering_answers_in_arrival_order() {
    let policy = Policy { batching: BatchPolicy::new(8, None), queue: QueuePolicy::new(None), preserve_ordering: true };
    let s = scheduler_with(policy, vec![Box::new(Sleeper), Box::new(Sleeper)]);
    let mut slow = s.submit(request(300)).ok().unwrap();
    let fast = s.submit(request(0)).ok().unwrap();
    // The fast request ends first on the other instance, but is answered only after the slow one.
    let resp = fast.await.unwrap().unwrap();
    assert_eq!(values(&resp.outputs[0]), vec![0, 2]);
    let first = slow.try_recv().expect("the earlier request was answered first").unwrap();
    assert_eq!(values(&first.outputs[0]), vec![600, 602]);
}

#[tokio::test]
async fn expired_requests_are_rejected_while_the_instance_is_busy() {
    let db = crate::proto::inference::ModelDynamicBatching {
        default_queue_policy: Some(crate::proto::inference::ModelQueuePolicy {
            default_timeout_microseconds: 10_000,
            ..Default::default()
        }),
        ..Default::default()
    };
    let policy =
        Policy { batching: BatchPolicy::new(8, None), queue: QueuePolicy::new(Some(&db)), preserve_ordering: false };
    let s = scheduler_with(policy, vec![Box::new(Sleeper)]);
    let mut busy = s.submit(request(1000)).ok().unwrap();
    let queued = s.submit(request(0)).ok().unwrap();
    let e = queued.await.unwrap().unwrap_err();
    assert_eq!(e.message(), "Request timeout expired");
    assert!(busy.try_recv().is_err(), "rejected while the first request still ran");
    assert!(busy.await.unwrap().is_ok());
}

#[tokio::test]
async fn full_queue_rejects_at_once() {
    let db = crate::proto::inference::ModelDynamicBatching {
        default_queue_policy: Some(crate::proto::inference::ModelQueuePolicy {
            max_queue_size: 1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let policy =
        Policy { batching: BatchPolicy::new(8, None), queue: QueuePolicy::new(Some(&db)), preserve_ordering: false };
    let s = scheduler_with(policy, vec![Box::new(Sleeper)]);
    let running = s.submit(request(200)).ok().unwrap();
    // Wait until the instance took the first request, so the next one is the only one queued.
    while s.shared.lock().iter().count() > 0 {
        tokio::task::yield_now().await;
    }
    let queued = s.submit(request(0)).ok().unwrap();
    let refused = s.submit(request(0)).ok().unwrap().await.unwrap().unwrap_err();
    assert_eq!(refused.http_status(), 503);
    assert!(refused.message().contains("Exceeds maximum queue size"));
    assert!(running.await.unwrap().is_ok() && queued.await.unwrap().is_ok());
}

/// Panics on a negative first element; otherwise a Doubler.
struct Fragile;

impl ModelInstance for Fragile {
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        let first = i32::from_le_bytes(inputs[0].data[..4].try_into().unwrap());
        assert!(first >= 0, "a bug in the instance");
        Doubler { pause: Duration::ZERO }.execute(inputs, outputs)
    }
}

#[tokio::test]
async fn a_panicking_instance_fails_its_batch_and_is_restarted() {
    let policy = Policy { batching: BatchPolicy::new(8, None), queue: QueuePolicy::new(None), preserve_ordering: true };
    let schema =
        Arc::new(Schema { max_batch_size: 8, inputs: vec![spec("x")], outputs: vec![spec("y")], ..Default::default() });
    let stats = Arc::new(Stats::default());
    let ctx = ModelContext { name: "m".into(), version: 1, schema, stats: Arc::clone(&stats) };
    let rebuilt = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&rebuilt);
    let rebuild: Rebuild = Arc::new(move |_| {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Box::new(Fragile) as Box<dyn ModelInstance>)
    });
    let s = Scheduler::start(ctx, policy, vec![Box::new(Fragile)], Some(rebuild), Vec::new()).unwrap();
    let bad = s.submit(request(-5)).ok().unwrap();
    let good = s.submit(request(3)).ok().unwrap();
    assert!(bad.await.is_err(), "the panicked batch's caller gets an error");
    // preserve_ordering does not hold later replies behind the lost one.
    assert_eq!(values(&good.await.unwrap().unwrap().outputs[0]), vec![6, 8]);
    assert_eq!(rebuilt.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The gauge comes down once the instance thread is back from the batch (just after replies).
    let mut executing = stats.snapshot().executing;
    for _ in 0..500 {
        if executing == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        executing = stats.snapshot().executing;
    }
    assert_eq!(executing, 0, "the executing gauge came back down");
}

#[tokio::test]
async fn the_reaper_ends_with_its_version_even_with_requests_queued_without_deadlines() {
    let db = crate::proto::inference::ModelDynamicBatching {
        default_queue_policy: Some(crate::proto::inference::ModelQueuePolicy {
            allow_timeout_override: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let policy =
        Policy { batching: BatchPolicy::new(8, None), queue: QueuePolicy::new(Some(&db)), preserve_ordering: false };
    let s = scheduler_with(policy, vec![Box::new(Sleeper)]);
    let replies: Vec<_> = (0..3).map(|_| s.submit(request(50)).ok().unwrap()).collect();
    s.stop();
    let joined = tokio::task::spawn_blocking(move || s.join());
    tokio::time::timeout(Duration::from_secs(10), joined).await.expect("every thread ended").unwrap();
    for r in replies {
        assert!(r.await.unwrap().is_ok());
    }
}

/// Inputs and outputs in GPU memory (host memory standing in) reach an instance without device
/// I/O through the host: the pieces gathered into the batch, each output copied into its
/// request's range and the reply carrying it empty; a range too small fails only its request.
#[tokio::test]
async fn gpu_memory_passes_through_the_host_for_a_host_instance() {
    use crate::device::{DeviceMemory, HostMemory};
    let memory = HostMemory::new(0, vec![0u8; 64]);
    let policy = delayed(Duration::from_millis(50));
    let (s, _) = scheduler(policy, 1, Duration::ZERO);
    let replies: Vec<_> = (0..3)
        .map(|v| {
            let mut r = request(v);
            let input = r.inputs[0].as_mut().unwrap();
            memory.write(v as u64 * 8, &std::mem::take(&mut input.data)).unwrap();
            input.device = Some(memory.range(v as u64 * 8, 8));
            let room = if v == 2 { 4 } else { 8 };
            r.device_outputs = vec![(0, memory.range(32 + v as u64 * 8, room))];
            s.submit(r).ok().unwrap()
        })
        .collect();
    let mut results = Vec::new();
    for reply in replies {
        results.push(reply.await.unwrap());
    }
    for (v, result) in results.iter().take(2).enumerate() {
        let out = &result.as_ref().unwrap().outputs[0];
        assert!(out.data.is_empty() && out.shape == vec![1, 2], "{out:?}");
        let at = 32 + v * 8;
        let written: Vec<i32> =
            memory.snapshot()[at..at + 8].chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(written, vec![2 * v as i32, 2 * v as i32 + 2]);
    }
    let e = results[2].as_ref().unwrap_err();
    assert!(e.message().contains("(4 bytes) should be at least 8 bytes"), "{e}");
    assert_eq!(memory.snapshot()[48..52], [0; 4], "nothing is written where it does not fit");
}

#[tokio::test]
async fn a_dropped_reply_takes_its_request_and_its_ticket_out_of_the_queue_at_once() {
    let admission = crate::admission::Admission::new(1 << 20);
    let policy = Policy { batching: BatchPolicy::new(8, None), queue: QueuePolicy::new(None), preserve_ordering: true };
    let stats = Arc::new(Stats::default());
    let schema =
        Arc::new(Schema { max_batch_size: 8, inputs: vec![spec("x")], outputs: vec![spec("y")], ..Default::default() });
    let ctx = ModelContext { name: "m".into(), version: 1, schema, stats: Arc::clone(&stats) };
    let s = Scheduler::start(ctx, policy, vec![Box::new(Sleeper)], None, Vec::new()).unwrap();
    // The one instance is busy for a while; three requests queue behind it, each with its ticket.
    let busy = s.submit(request(400)).ok().unwrap();
    while stats.snapshot().executing == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let queued: Vec<Reply> = (0..3)
        .map(|v| {
            let mut r = request(v);
            r.context.ticket = Some(Arc::new(admission.admit(1000).unwrap()));
            s.submit(r).ok().unwrap()
        })
        .collect();
    assert_eq!((admission.counts().used, admission.counts().live), (3000, 3));
    let mut queued = queued.into_iter();
    let (first, last) = (queued.next().unwrap(), queued.next_back().unwrap());
    drop(queued);
    drop(first);
    // Gone while the instance is still busy: the queue no longer holds them or their bytes.
    assert_eq!((admission.counts().used, admission.counts().live), (1000, 1));
    assert_eq!(stats.snapshot().pending, 1);
    assert_eq!(values(&busy.await.unwrap().unwrap().outputs[0]), vec![800, 802]);
    // Arrival order still holds for the rest: the one kept is answered.
    assert_eq!(values(&last.await.unwrap().unwrap().outputs[0]), vec![4, 6]);
    // Its ticket goes with the batch's buffers, once the instance thread is done with them.
    for _ in 0..5000 {
        if admission.counts().live == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(admission.counts().live, 0);
}

/// A Doubler that may run anywhere, noting the thread of each batch.
struct Anywhere {
    inner: Doubler,
    threads: Arc<std::sync::Mutex<Vec<std::thread::ThreadId>>>,
}

impl ModelInstance for Anywhere {
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        self.threads.lock().unwrap().push(std::thread::current().id());
        self.inner.execute(inputs, outputs)
    }
    fn runs_anywhere(&self) -> bool {
        true
    }
}

type Threads = Arc<std::sync::Mutex<Vec<std::thread::ThreadId>>>;

fn anywhere(batching: BatchPolicy, instances: usize, pause: Duration) -> (Scheduler, Arc<Stats>, Threads) {
    anywhere_lingering(batching, instances, pause, LINGER_MAX)
}

fn anywhere_lingering(
    batching: BatchPolicy,
    instances: usize,
    pause: Duration,
    linger_max: Duration,
) -> (Scheduler, Arc<Stats>, Threads) {
    let policy = Policy { batching, queue: QueuePolicy::new(None), preserve_ordering: false };
    let schema =
        Arc::new(Schema { max_batch_size: 8, inputs: vec![spec("x")], outputs: vec![spec("y")], ..Default::default() });
    let stats = Arc::new(Stats::default());
    let ctx = ModelContext { name: "m".into(), version: 1, schema, stats: Arc::clone(&stats) };
    let threads = Threads::default();
    let instances: Vec<Box<dyn ModelInstance>> = (0..instances)
        .map(|_| {
            Box::new(Anywhere { inner: Doubler { pause }, threads: Arc::clone(&threads) }) as Box<dyn ModelInstance>
        })
        .collect();
    (Scheduler::start_with(ctx, policy, instances, None, Vec::new(), linger_max).unwrap(), stats, threads)
}

/// Submits lone requests, apart in time, until one runs on the calling thread (at most 400:
/// whether a model is light is measured, and on a loaded machine a batch may be preempted and
/// measured slow): each answer checked, and each no sooner than `delay`. Returns how many ran.
fn lone_requests_until_one_runs_here(s: &Scheduler, threads: &Threads, delay: Duration) -> usize {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let here = std::thread::current().id();
    for v in 0..400 {
        let started = std::time::Instant::now();
        let resp = rt.block_on(s.submit(request(v)).ok().unwrap()).unwrap().unwrap();
        assert_eq!(values(&resp.outputs[0]), vec![2 * v, 2 * v + 2]);
        // A queue delay is still waited out (for company that might come), wherever it is.
        assert!(started.elapsed() >= delay);
        if threads.lock().unwrap().last() == Some(&here) {
            return v as usize + 1;
        }
        wait_until_free(s);
    }
    panic!("no request ran on the caller's thread: {:?}", threads.lock().unwrap());
}

#[test]
fn a_light_model_runs_on_the_callers_thread_once_it_is_known_to_be_light() {
    let (s, stats, threads) = anywhere(BatchPolicy::new(8, None), 1, Duration::ZERO);
    let ran = lone_requests_until_one_runs_here(&s, &threads, Duration::ZERO);
    let here = std::thread::current().id();
    assert_ne!(threads.lock().unwrap()[0], here, "the first batch (of unknown cost) runs on the instance's thread");
    assert_eq!(stats.snapshot().inference_count, ran as u64);
}

#[test]
fn a_slow_model_stays_on_its_instance_threads() {
    let (s, _, threads) = anywhere(BatchPolicy::new(8, None), 1, Duration::from_millis(2));
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    for v in 0..3 {
        rt.block_on(s.submit(request(v)).ok().unwrap()).unwrap().unwrap();
    }
    let here = std::thread::current().id();
    assert!(threads.lock().unwrap().iter().all(|t| *t != here));
}

#[test]
fn a_lone_request_under_a_queue_delay_waits_on_the_instance_thread() {
    let policy = delayed(Duration::from_millis(5));
    let (s, stats, threads) = anywhere(policy, 1, Duration::ZERO);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    for v in 0..3 {
        rt.block_on(s.submit(request(v)).ok().unwrap()).unwrap().unwrap();
    }
    let here = std::thread::current().id();
    assert!(threads.lock().unwrap().iter().all(|t| *t != here), "the batcher waits for company first");
    assert_eq!(stats.snapshot().inference_count, 3);
}

#[test]
fn a_lone_request_under_a_short_queue_delay_waits_on_the_callers_thread() {
    let delay = Duration::from_micros(200);
    let policy = delayed(delay);
    let (s, stats, threads) = anywhere(policy, 1, Duration::ZERO);
    let ran = lone_requests_until_one_runs_here(&s, &threads, delay);
    let here = std::thread::current().id();
    assert_ne!(threads.lock().unwrap()[0], here, "the first batch (of unknown cost) runs on the instance's thread");
    assert_eq!(stats.snapshot().inference_count, ran as u64);
}

/// Waits until the instance threads, having answered, have freed their instances.
fn wait_until_free(s: &Scheduler) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.shared.lock().seats.iter().any(|seat| seat.busy) {
        assert!(std::time::Instant::now() < deadline, "an instance was never freed");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs batches of `rows` lone requests at once (on the instance's thread) until the model counts
/// as light and its instance is free again: whether a model is light is measured, and on a loaded
/// machine a batch may be preempted and measured slow. Returns the requests and batches it ran.
fn warm_until_light(s: &Scheduler, rows: usize) -> (u64, u64) {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    for round in 1..=400u64 {
        let replies: Vec<_> = (0..rows).map(|v| s.submit(request(v as i32)).ok().unwrap()).collect();
        for r in replies {
            assert!(rt.block_on(r).unwrap().is_ok());
        }
        wait_until_free(s);
        if s.shared.recent.light_for(64) {
            return (round * rows as u64, round);
        }
    }
    panic!("the model never counted as light");
}

/// Company that arrives while the caller waits joins its batch.
#[test]
fn requests_arriving_while_a_caller_waits_join_its_batch() {
    // A delay long enough that only the second request ends the wait (no race with the clock).
    let delay = Duration::from_secs(30);
    let policy =
        BatchPolicy { max_batch_size: 8, dynamic: true, preferred: vec![2], max_delay: delay, adaptive: false };
    let (s, stats, _) = anywhere_lingering(policy, 1, Duration::ZERO, delay);
    let s = Arc::new(s);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    // The first batches (of unknown cost) run on the instance's thread: preferred batches of two.
    let (warm_requests, warm_batches) = warm_until_light(&s, 2);
    // A second caller submits as soon as the first is seen waiting: the preferred batch of 2
    // then runs at once (one execution), before the delay is out.
    let other = Arc::clone(&s);
    let helper = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !other.shared.lock().lingering {
            assert!(std::time::Instant::now() < deadline, "the first caller never waited");
            std::thread::yield_now();
        }
        rt.block_on(other.submit(request(20)).ok().unwrap()).unwrap().unwrap()
    });
    let first = rt.block_on(s.submit(request(10)).ok().unwrap()).unwrap().unwrap();
    let second = helper.join().unwrap();
    assert_eq!(values(&first.outputs[0]), vec![20, 22]);
    assert_eq!(values(&second.outputs[0]), vec![40, 42]);
    let snap = stats.snapshot();
    assert_eq!((snap.inference_count, snap.execution_count), (warm_requests + 2, warm_batches + 1));
}

/// A caller whose own request expires while it waits for company stops waiting at once: its
/// reply goes out, and a later request's wait is the instance thread's.
#[test]
fn a_caller_whose_request_expires_stops_waiting_for_the_others() {
    let delay = Duration::from_secs(30);
    let db = crate::proto::inference::ModelDynamicBatching {
        max_queue_delay_microseconds: 30_000_000,
        default_queue_policy: Some(crate::proto::inference::ModelQueuePolicy {
            allow_timeout_override: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let policy = Policy {
        batching: BatchPolicy::new(8, Some(&db)),
        queue: QueuePolicy::new(Some(&db)),
        preserve_ordering: false,
    };
    let schema =
        Arc::new(Schema { max_batch_size: 8, inputs: vec![spec("x")], outputs: vec![spec("y")], ..Default::default() });
    let stats = Arc::new(Stats::default());
    let ctx = ModelContext { name: "m".into(), version: 1, schema, stats: Arc::clone(&stats) };
    let threads = Threads::default();
    let instance = Box::new(Anywhere { inner: Doubler { pause: Duration::ZERO }, threads }) as Box<dyn ModelInstance>;
    let s = Arc::new(Scheduler::start_with(ctx, policy, vec![instance], None, Vec::new(), delay).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    // Made known to be light by batches full at once (on the instance's thread).
    warm_until_light(&s, 8);
    let other = Arc::clone(&s);
    let helper = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !other.shared.lock().lingering {
            assert!(std::time::Instant::now() < deadline, "the first caller never waited");
            std::thread::yield_now();
        }
        // Company with a long timeout.
        let mut late = request(50);
        late.timeout_us = Some(120_000_000);
        other.submit(late).ok().unwrap()
    });
    let mut mine = request(10);
    mine.timeout_us = Some(100_000);
    let reply = s.submit(mine).ok().unwrap();
    let late = helper.join().unwrap();
    let e = rt.block_on(reply).unwrap().unwrap_err();
    assert_eq!(e.message(), "Request timeout expired");
    // The caller returned while the other request still waits for company in the queue.
    assert_eq!(s.shared.lock().len(), 1, "the caller waited on for a request not its own");
    let stopped = std::time::Instant::now();
    s.stop();
    assert!(rt.block_on(late).unwrap().is_ok(), "flushed by the stop");
    s.join();
    // The reaper does not sleep out the deadline of a request the stop flushed (120 s).
    assert!(stopped.elapsed() < Duration::from_secs(60), "the threads ended {:?} after the stop", stopped.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_and_instance_threads_share_the_instances_without_losing_a_request() {
    for batching in [BatchPolicy::new(8, None), delayed(Duration::from_micros(50))] {
        let (s, stats, threads) = anywhere(batching, 2, Duration::ZERO);
        let s = Arc::new(s);
        let tasks: Vec<_> = (0..16)
            .map(|t| {
                let s = Arc::clone(&s);
                tokio::spawn(async move {
                    for k in 0..200 {
                        let v = t * 1000 + k;
                        let resp = s.submit(request(v)).ok().unwrap().await.unwrap().unwrap();
                        assert_eq!(values(&resp.outputs[0]), vec![2 * v, 2 * v + 2]);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(stats.snapshot().inference_count, 3200);
        let batches = threads.lock().unwrap().len() as u64;
        assert_eq!(batches, stats.snapshot().execution_count);
        s.stop();
        s.join();
    }
}

/// `n` rows of two INT32s each, starting at `v`.
fn rows(v: i32, n: usize) -> ValidatedRequest {
    let data: Vec<u8> = (0..2 * n as i32).flat_map(|x| (v + x).to_le_bytes()).collect();
    ValidatedRequest {
        rows: n,
        inputs: vec![Some(ModelTensor::host(vec![n as i64, 2], Bytes::from(data)))],
        ..request(v)
    }
}

fn a_minute_of_delay(adaptive: bool) -> BatchPolicy {
    delayed(Duration::from_secs(60)).adaptive(adaptive)
}

/// Full batches, one at a time: each finds the version idle, and none waits.
async fn one_at_a_time(s: &Scheduler, n: u32) {
    for v in 0..n {
        s.submit(rows(v as i32, 8)).ok().unwrap().await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn adaptive_a_lone_request_runs_at_once_while_requests_come_one_at_a_time() {
    let (s, stats) = scheduler(a_minute_of_delay(true), 1, Duration::ZERO);
    one_at_a_time(&s, seats::ALONE_RUNS).await;
    // A minute of queue delay, not waited out: the reply comes long before.
    let reply = s.submit(request(5)).ok().unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), reply).await.expect("answered without the delay");
    assert_eq!(values(&resp.unwrap().unwrap().outputs[0]), vec![10, 12]);
    assert_eq!(stats.snapshot().execution_count, u64::from(seats::ALONE_RUNS) + 1);
}

#[tokio::test]
async fn without_adaptive_a_lone_request_waits_for_company() {
    let (s, _) = scheduler(a_minute_of_delay(false), 1, Duration::ZERO);
    one_at_a_time(&s, seats::ALONE_RUNS).await;
    let mut reply = s.submit(request(5)).ok().unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(300), &mut reply).await.is_err(), "it waits for company");
    // Company fills the batch, and both are answered.
    let filler = s.submit(rows(0, 7)).ok().unwrap();
    assert_eq!(values(&reply.await.unwrap().unwrap().outputs[0]), vec![10, 12]);
    filler.await.unwrap().unwrap();
}

#[tokio::test]
async fn adaptive_a_request_that_arrives_while_another_is_unanswered_brings_the_wait_back() {
    // A run long enough that the second request arrives while the first runs, on a busy machine
    // too (with 50 ms, the first was answered before the second came 3 times in 8 under load).
    let (s, stats) = scheduler(a_minute_of_delay(true), 1, Duration::from_millis(200));
    one_at_a_time(&s, seats::ALONE_RUNS).await;
    // A reply leaves before its batch's statistics are kept: wait for those, or the first's
    // "executing" below could be the last batch's (then the second came while the first still
    // queued, and both waited for company: 2 failures in 8 runs under load).
    let done = || stats.snapshot().batches.get(&8).map(|b| b.compute_infer.count) == Some(u64::from(seats::ALONE_RUNS));
    while !done() || stats.snapshot().executing != 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The first runs at once; the second arrives while it runs, and waits for company again.
    let first = s.submit(request(1)).ok().unwrap();
    while stats.snapshot().executing == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut second = s.submit(request(2)).ok().unwrap();
    first.await.unwrap().unwrap();
    // Longer than a run: had it not waited, it would be answered by then.
    assert!(tokio::time::timeout(Duration::from_millis(600), &mut second).await.is_err(), "it waits for company");
    let company: Vec<_> = (10..17).map(|v| s.submit(request(v)).ok().unwrap()).collect();
    assert_eq!(values(&second.await.unwrap().unwrap().outputs[0]), vec![4, 6]);
    for c in company {
        c.await.unwrap().unwrap();
    }
    // The second and its company ran as one batch of 8.
    assert_eq!(stats.snapshot().batches.get(&8).map(|b| b.compute_infer.count), Some(u64::from(seats::ALONE_RUNS) + 1));
}
