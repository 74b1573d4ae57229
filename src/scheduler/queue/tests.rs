use super::*;
use crate::proto::inference::ModelQueuePolicy;

fn request(priority: u64, timeout_us: Option<u64>) -> ValidatedRequest {
    ValidatedRequest {
        id: format!("p{priority}"),
        parameters: Default::default(),
        rows: 1,
        inputs: vec![],
        outputs: vec![],
        batch_key: vec![],
        priority,
        timeout_us,
        span: tracing::Span::none(),
        stream: None,
        device_outputs: Vec::new(),
        context: Default::default(),
    }
}

fn push(
    q: &mut Queue,
    priority: u64,
    timeout_us: Option<u64>,
    now: Instant,
) -> Result<oneshot::Receiver<Result<InferResponse>>> {
    let (tx, rx) = oneshot::channel();
    q.push(request(priority, timeout_us), tx, now).map(|_| rx).map_err(|(e, _)| e)
}

fn policy(levels: u64, default: u64, queue: ModelQueuePolicy) -> QueuePolicy {
    let db = ModelDynamicBatching {
        priority_levels: levels,
        default_priority_level: default,
        default_queue_policy: Some(queue),
        ..Default::default()
    };
    QueuePolicy::new(Some(&db))
}

fn ids(q: &Queue) -> Vec<String> {
    q.iter().map(|j| j.req.id.clone()).collect()
}

#[test]
fn higher_priority_levels_go_first() {
    let now = Instant::now();
    let mut q = Queue::new(policy(3, 2, ModelQueuePolicy::default()));
    let _r: Vec<_> = [3, 0, 1, 9, 2].iter().map(|&p| push(&mut q, p, None, now).unwrap()).collect();
    // 0 and 9 fall to the default level 2.
    assert_eq!(ids(&q), vec!["p1", "p0", "p9", "p2", "p3"]);
    assert_eq!(q.take(2).iter().map(|j| j.seq).collect::<Vec<_>>(), vec![2, 1]);
    assert_eq!(ids(&q), vec!["p9", "p2", "p3"]);
}

#[test]
fn full_queue_refuses() {
    let now = Instant::now();
    let mut q = Queue::new(policy(0, 0, ModelQueuePolicy { max_queue_size: 2, ..Default::default() }));
    let _a = push(&mut q, 0, None, now).unwrap();
    let _b = push(&mut q, 0, None, now).unwrap();
    let e = push(&mut q, 0, None, now).unwrap_err();
    assert_eq!(e.http_status(), 503);
    assert!(e.message().starts_with("[request id: p0] Exceeds maximum queue size"), "{e}");
}

#[test]
fn reject_on_timeout() {
    let now = Instant::now();
    let mut q = Queue::new(policy(0, 0, ModelQueuePolicy { default_timeout_microseconds: 100, ..Default::default() }));
    let _a = push(&mut q, 0, None, now).unwrap();
    assert_eq!(q.next_deadline(), Some(now + Duration::from_micros(100)));
    assert!(q.sweep(now + Duration::from_micros(99)).is_empty());
    let expired = q.sweep(now + Duration::from_micros(100));
    assert_eq!(expired.len(), 1);
    assert_eq!(expired[0].1.message(), "Request timeout expired");
    assert!(q.is_empty());
}

#[test]
fn delay_on_timeout_moves_behind_fresh_requests() {
    let now = Instant::now();
    let delay = ModelQueuePolicy { default_timeout_microseconds: 100, timeout_action: 1, ..Default::default() };
    let mut q = Queue::new(policy(0, 0, delay));
    let _a = push(&mut q, 0, None, now).unwrap();
    let later = now + Duration::from_micros(150);
    let _b = push(&mut q, 0, None, later).unwrap();
    assert!(q.sweep(later).is_empty());
    assert_eq!(q.iter().map(|j| j.seq).collect::<Vec<_>>(), vec![1, 0]);
    assert_eq!(q.next_deadline(), Some(later + Duration::from_micros(100)));
}

#[test]
fn request_timeouts_override_only_when_allowed_and_shorter() {
    let now = Instant::now();
    let allowed =
        ModelQueuePolicy { default_timeout_microseconds: 1000, allow_timeout_override: true, ..Default::default() };
    let mut q = Queue::new(policy(0, 0, allowed));
    let _a = push(&mut q, 0, Some(10), now).unwrap();
    let _b = push(&mut q, 0, Some(5000), now).unwrap();
    let deadlines: Vec<_> = q.iter().map(|j| j.deadline.unwrap() - now).collect();
    assert_eq!(deadlines, vec![Duration::from_micros(10), Duration::from_micros(1000)]);
    let mut q = Queue::new(policy(0, 0, ModelQueuePolicy::default()));
    let _c = push(&mut q, 0, Some(10), now).unwrap();
    assert_eq!(q.next_deadline(), None, "without allow_timeout_override the request timeout is ignored");
    let no_default = ModelQueuePolicy { allow_timeout_override: true, ..Default::default() };
    let mut q = Queue::new(policy(0, 0, no_default));
    let _d = push(&mut q, 0, Some(10), now).unwrap();
    assert_eq!(q.next_deadline(), Some(now + Duration::from_micros(10)));
}

#[test]
fn abandoned_requests_are_swept() {
    let now = Instant::now();
    let mut q = Queue::new(QueuePolicy::new(None));
    drop(push(&mut q, 0, None, now).unwrap());
    let _kept = push(&mut q, 0, None, now).unwrap();
    let gone = q.sweep(now);
    assert_eq!(gone.len(), 1);
    assert_eq!(q.iter().count(), 1);
}

#[test]
fn sweeping_a_long_queue_touches_the_expired_and_the_front_only() {
    let now = Instant::now();
    let mut q = Queue::new(policy(
        0,
        0,
        ModelQueuePolicy { allow_timeout_override: true, default_timeout_microseconds: 0, ..Default::default() },
    ));
    let mut replies = Vec::new();
    for i in 0..20_000u64 {
        // Every 1000th request has a 1 ms deadline; the others none.
        let timeout = (i % 1000 == 999).then_some(1000);
        replies.push(push(&mut q, 0, timeout, now).unwrap());
    }
    assert_eq!(q.next_deadline(), Some(now + Duration::from_millis(1)));
    // The callers of a request at the front and one far back go away.
    drop(replies.remove(0));
    drop(replies.remove(15_000));
    let swept = q.sweep(now + Duration::from_millis(2));
    let expired = swept.iter().filter(|(_, e)| e.message() == "Request timeout expired").count();
    let cancelled = swept.iter().filter(|(_, e)| e.message() == "request cancelled").count();
    assert_eq!((expired, cancelled), (20, 1), "the deep cancelled one waits until it nears the front");
    assert_eq!(q.iter().count(), 20_000 - 21);
    assert_eq!(q.next_deadline(), None);
    let taken = q.take(14_000);
    assert_eq!(taken.len(), 14_000);
    let swept = q.sweep(now + Duration::from_millis(3));
    assert_eq!(swept.len(), 1, "now near the front, the cancelled request is found");
}

#[test]
fn a_timeout_past_the_end_of_time_is_no_timeout() {
    let now = Instant::now();
    let forever =
        ModelQueuePolicy { default_timeout_microseconds: u64::MAX, allow_timeout_override: true, ..Default::default() };
    let mut q = Queue::new(policy(0, 0, forever));
    let _a = push(&mut q, 0, Some(u64::MAX), now).unwrap();
    let _b = push(&mut q, 0, None, now).unwrap();
    assert!(q.sweep(now + Duration::from_secs(3600)).is_empty());
}
