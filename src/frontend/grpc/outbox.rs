//! A `ModelStreamInfer` stream's replies on their way to the connection. Replies made and not yet
//! taken wait here, then in the channel that tonic reads; every one is charged to admission until
//! tonic takes it, so a client that reads slowly holds its replies against the server's budget.
//! A client that takes none for the stall timeout has its stream ended and its replies dropped:
//! one that keeps its connection alive but never reads cannot hold the budget for ever.
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

pub(super) struct Outbox {
    /// Replies made and not yet in the channel, in the order they go out.
    pub waiting: VecDeque<Reply>,
    /// What the waiting replies, and those in the channel, are charged to.
    holder: Arc<Ticket>,
    /// The channel's receiving end, owned by the stream tonic reads (a client that leaves drops
    /// it, which the sender sees), reached from here to drop a stalled stream's replies while
    /// tonic is not reading.
    rx: Weak<Mutex<mpsc::Receiver<Reply>>>,
    /// Messages tonic has taken.
    taken: Arc<AtomicU64>,
    /// At the last look: whether replies waited, and how many tonic had taken.
    last: (bool, u64),
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
        let (rx, taken) = (Arc::new(Mutex::new(rx)), Arc::new(AtomicU64::new(0)));
        let outbox = Outbox {
            waiting: VecDeque::new(),
            holder: Arc::new(holder),
            rx: Arc::downgrade(&rx),
            taken: Arc::clone(&taken),
            last: (false, 0),
            stall,
        };
        let messages = futures_util::stream::poll_fn(move |cx| {
            let next = rx.lock().unwrap_or_else(|p| p.into_inner()).poll_recv(cx);
            if let Poll::Ready(Some(_)) = &next {
                taken.fetch_add(1, Ordering::Relaxed);
            }
            next.map(|reply| reply.map(|(msg, _charge)| msg))
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

    /// Looked at once per stall timeout: true when replies waited at the last look and still
    /// do, and tonic took none since (the client read nothing for at least that long).
    pub fn stalled(&mut self, tx: &StreamSender) -> bool {
        let waiting = !self.waiting.is_empty() || tx.capacity() < tx.max_capacity();
        let taken = self.taken.load(Ordering::Relaxed);
        let stalled = waiting && self.last.0 && taken == self.last.1;
        self.last = (waiting, taken);
        stalled
    }

    /// Ends a stalled stream: its replies are dropped (their charges given back) and, should the
    /// client read again, the error says why. Returns how many replies were dropped.
    pub fn end_stalled(&mut self, tx: &StreamSender) -> usize {
        let mut dropped = self.waiting.len();
        self.waiting.clear();
        if let Some(rx) = self.rx.upgrade() {
            let mut rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            while rx.try_recv().is_ok() {
                dropped += 1;
            }
        }
        let why = Status::resource_exhausted(format!(
            "the client took none of this stream's replies for {} s (--grpc-stream-stall-timeout-secs): the \
             stream was ended and its {dropped} waiting replies dropped",
            self.stall.as_secs()
        ));
        let _ = tx.try_send((Err(why), Charge::default()));
        dropped
    }
}
