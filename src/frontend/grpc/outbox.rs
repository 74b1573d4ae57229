//! A `ModelStreamInfer` stream's replies on their way to the connection. Replies made and not yet
//! taken wait here, then in the channel that tonic reads; every one is charged to admission until
//! tonic takes it, so a client that reads slowly holds its replies against the server's budget.
//! A client that takes none for the stall timeout (longer after a large reply, which it may
//! still be reading) has its stream ended and its replies dropped: one that keeps its connection
//! alive but never reads cannot hold the budget for ever.
use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU64, Ordering},
    },
    task::Poll,
    time::Duration,
};

use prost::Message;
use tokio::sync::mpsc;
use tonic::Status;

use crate::{admission::Ticket, proto::inference as pb, request::Charge};

/// One message of a `ModelStreamInfer` stream.
pub(super) type StreamItem = Result<pb::ModelStreamInferResponse, Status>;
/// A message on its way out, with the bytes it holds charged until the connection takes it.
pub(super) type Reply = (StreamItem, Charge);
/// A `ModelStreamInfer` stream's messages on their way out.
pub(super) type StreamSender = mpsc::Sender<Reply>;

/// The slowest a client may read a large reply: after tonic takes a reply of `n` bytes, the
/// stall timeout is longer by the time `n` bytes take at this rate.
const MIN_READ_RATE: u64 = 64 << 10;

/// The channel's receiving end, owned by the stream tonic reads.
struct Tail {
    rx: mpsc::Receiver<Reply>,
    /// The error that ends a stalled stream, sent after what is left (should tonic read again).
    ended: Option<Status>,
}

/// What tonic took: messages, and the size of the last.
#[derive(Default)]
struct Taken {
    count: AtomicU64,
    last_bytes: AtomicU64,
}

pub(super) struct Outbox {
    /// Replies made and not yet in the channel, in the order they go out.
    pub waiting: VecDeque<Reply>,
    /// What the waiting replies, and those in the channel, are charged to.
    holder: Arc<Ticket>,
    /// Reached from here to drop a stalled stream's replies while tonic is not reading; gone
    /// once the client left (tonic dropped the stream), which the channel's sender sees too.
    tail: Weak<Mutex<Tail>>,
    taken: Arc<Taken>,
    /// Since replies began to wait with none taken: how long, counted in looks (None: not
    /// waiting, or some taken since the last look), and how many tonic had taken then.
    quiet: (Option<Duration>, u64),
    pub stall: Duration,
}

impl Outbox {
    /// An outbox, the channel's sending end (with room for `capacity` messages) and the stream
    /// of messages for tonic, each message's charge ending as tonic takes it.
    pub fn new(
        holder: Ticket,
        capacity: usize,
        stall: Duration,
    ) -> (Outbox, StreamSender, impl tokio_stream::Stream<Item = StreamItem> + Send + 'static) {
        let (tx, rx) = mpsc::channel(capacity);
        let tail = Arc::new(Mutex::new(Tail { rx, ended: None }));
        let taken = Arc::new(Taken::default());
        let outbox = Outbox {
            waiting: VecDeque::new(),
            holder: Arc::new(holder),
            tail: Arc::downgrade(&tail),
            taken: Arc::clone(&taken),
            quiet: (None, 0),
            stall,
        };
        let messages = futures_util::stream::poll_fn(move |cx| {
            let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
            match tail.rx.poll_recv(cx) {
                Poll::Ready(Some((msg, charge))) => {
                    taken.last_bytes.store(charge.bytes(), Ordering::Relaxed);
                    taken.count.fetch_add(1, Ordering::Relaxed);
                    Poll::Ready(Some(msg))
                }
                Poll::Ready(None) => Poll::Ready(tail.ended.take().map(Err)),
                Poll::Pending => Poll::Pending,
            }
        });
        (outbox, tx, messages)
    }

    /// A reply made: it waits its turn, charged (an error status holds nothing).
    pub fn push(&mut self, item: StreamItem) {
        let charge = match &item {
            Ok(msg) => Charge::held(&self.holder, msg.encoded_len() as u64),
            Err(_) => Charge::default(),
        };
        self.waiting.push_back((item, charge));
    }

    /// Replies wait in the channel for tonic.
    pub fn in_channel(&self) -> bool {
        self.tail.upgrade().is_some_and(|t| !t.lock().unwrap_or_else(|p| p.into_inner()).rx.is_empty())
    }

    /// Looked at once per stall timeout: true when replies have waited with none taken for the
    /// stall timeout, plus the time the last reply taken needs at `MIN_READ_RATE` (the client
    /// may still be reading it).
    pub fn stalled(&mut self) -> bool {
        let taken = self.taken.count.load(Ordering::Relaxed);
        let waiting = !self.waiting.is_empty() || self.in_channel();
        let quiet = match self.quiet {
            (Some(quiet), before) if waiting && before == taken => quiet + self.stall,
            _ if waiting => Duration::ZERO,
            _ => {
                self.quiet = (None, taken);
                return false;
            }
        };
        self.quiet = (Some(quiet), taken);
        let reading = Duration::from_secs(self.taken.last_bytes.load(Ordering::Relaxed) / MIN_READ_RATE);
        quiet >= self.stall + reading
    }

    /// Ends a stalled stream: its replies are dropped (their charges given back) and, should the
    /// client read again, the error says why once the senders are gone. Returns how many replies
    /// were dropped.
    pub fn end_stalled(&mut self) -> usize {
        let mut dropped = self.waiting.len();
        self.waiting.clear();
        if let Some(tail) = self.tail.upgrade() {
            let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
            while tail.rx.try_recv().is_ok() {
                dropped += 1;
            }
            tail.ended = Some(Status::resource_exhausted(format!(
                "the client took none of this stream's replies for {} s (--grpc-stream-stall-timeout-secs): the \
                 stream was ended and its {dropped} waiting replies dropped",
                self.stall.as_secs()
            )));
        }
        dropped
    }
}
