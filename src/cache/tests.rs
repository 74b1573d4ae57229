use std::sync::Arc;

use bytes::Bytes;

use super::*;
use crate::{
    request::{InputTensor, ParamValue, RequestedOutput},
    tensor::DataType,
};

fn request(data: &[u8], shape: Vec<i64>, datatype: DataType) -> InferRequest {
    InferRequest {
        model_name: "m".into(),
        inputs: vec![
            InputTensor::host("B", datatype, shape.clone(), Bytes::copy_from_slice(data)),
            InputTensor::host("A", datatype, shape, Bytes::copy_from_slice(data)),
        ],
        ..Default::default()
    }
}

#[test]
fn the_key_sees_every_part_of_a_request() {
    let base = request(&[1, 2, 3, 4], vec![1, 4], DataType::Uint8);
    let k = key("m", 1, "c", &base);
    assert_eq!(k, key("m", 1, "c", &base.clone()), "deterministic");
    let mut reordered = base.clone();
    reordered.inputs.reverse();
    assert_eq!(k, key("m", 1, "c", &reordered), "input order does not matter");
    let mut id = base.clone();
    id.id = "other".into();
    assert_eq!(k, key("m", 1, "c", &id), "the request id is not part of the response's content");
    let mut differ = vec![
        key("m", 2, "c", &base),
        key("m", 1, "other content", &base),
        key("n", 1, "c", &base),
        key("m", 1, "c", &request(&[1, 2, 3, 5], vec![1, 4], DataType::Uint8)),
        key("m", 1, "c", &request(&[1, 2, 3, 4], vec![4, 1], DataType::Uint8)),
        key("m", 1, "c", &request(&[1, 2, 3, 4], vec![1, 4], DataType::Int8)),
    ];
    let mut flipped = base.clone();
    flipped.inputs[1].data = Bytes::from_static(&[1, 2, 3, 4 ^ 0x80]);
    differ.push(key("m", 1, "c", &flipped));
    let mut renamed = base.clone();
    renamed.inputs[0].name = "C".into();
    differ.push(key("m", 1, "c", &renamed));
    let mut one_output = base.clone();
    one_output.outputs = vec![RequestedOutput { name: "Y".into(), ..Default::default() }];
    differ.push(key("m", 1, "c", &one_output));
    let mut classified = one_output.clone();
    classified.outputs[0].classification = Some(3);
    differ.push(key("m", 1, "c", &classified));
    // Moving a byte from one input to the next keeps the concatenation but not the key.
    let mut moved = base.clone();
    moved.inputs[0].data = Bytes::from_static(&[1, 2, 3]);
    moved.inputs[1].data = Bytes::from_static(&[4, 1, 2, 3, 4]);
    differ.push(key("m", 1, "c", &moved));
    for (i, d) in differ.iter().enumerate() {
        assert_ne!(&k, d, "variant {i} must not share the key");
    }
    differ.sort();
    differ.dedup();
    assert_eq!(differ.len(), 11, "variants differ from each other too");
}

fn sample() -> Cached {
    let mut parameters = Parameters::new();
    parameters.insert("b".into(), ParamValue::Bool(true));
    parameters.insert("i".into(), ParamValue::Int(-3));
    parameters.insert("u".into(), ParamValue::Uint(7));
    parameters.insert("d".into(), ParamValue::Double(0.5));
    parameters.insert("s".into(), ParamValue::String("x".into()));
    Cached {
        parameters,
        outputs: vec![
            Tensor { name: "Y".into(), datatype: DataType::Fp32, shape: vec![1, 2], data: Bytes::from_static(&[0; 8]) },
            Tensor {
                name: "Z".into(),
                datatype: DataType::Bytes,
                shape: vec![1],
                data: Bytes::from_static(b"\x01\0\0\0a"),
            },
        ],
    }
}

#[test]
fn stored_responses_round_trip_and_damage_is_refused() {
    let c = sample();
    let enc = codec::encode(&c);
    assert_eq!(codec::decode(Bytes::from(enc.clone())), Some(c));
    for cut in [0, 3, 4, 20, enc.len() - 1] {
        assert_eq!(codec::decode(Bytes::copy_from_slice(&enc[..cut])), None, "cut at {cut}");
    }
    let mut longer = enc.clone();
    longer.push(0);
    assert_eq!(codec::decode(Bytes::from(longer)), None);
    let mut bad_magic = enc;
    bad_magic[0] = b'X';
    assert_eq!(codec::decode(Bytes::from(bad_magic)), None);
}

#[test]
fn a_hit_is_the_response_renamed_for_its_request() {
    let r = sample().response("m", 3, "req-9");
    assert_eq!((r.model_name.as_str(), r.model_version, r.id.as_str()), ("m", 3, "req-9"));
    assert_eq!(r.outputs, sample().outputs);
}

fn local(bytes: usize) -> Arc<ResponseCache> {
    ResponseCache::new(&CacheSettings { local_bytes: Some(bytes), redis: None }).unwrap()
}

#[tokio::test]
async fn identical_misses_compute_once() {
    let cache = local(1 << 20);
    let k = [9; 32];
    let Lookup::Miss(filler) = cache.lookup(k).await else { panic!("empty cache hit") };
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            let c = Arc::clone(&cache);
            tokio::spawn(async move { matches!(c.lookup(k).await, Lookup::Hit(_)) })
        })
        .collect();
    tokio::task::yield_now().await;
    filler.fill(&sample().response("m", 1, "first"));
    for w in waiters {
        assert!(w.await.unwrap(), "every waiter got the one computed response");
    }
    assert!(matches!(cache.lookup(k).await, Lookup::Hit(_)));
    assert_eq!(cache.counts().local_entries, 1);
}

#[tokio::test]
async fn a_failed_computation_lets_a_waiter_compute() {
    let cache = local(1 << 20);
    let k = [5; 32];
    let Lookup::Miss(first) = cache.lookup(k).await else { panic!() };
    let c = Arc::clone(&cache);
    let waiter = tokio::spawn(async move { matches!(c.lookup(k).await, Lookup::Miss(_)) });
    tokio::task::yield_now().await;
    drop(first);
    assert!(waiter.await.unwrap(), "the waiter becomes the one computing");
    assert_eq!(cache.counts().local_entries, 0, "nothing stored for a failure");
}

#[test]
fn an_entry_owns_its_bytes_not_its_batch_buffer() {
    // One request's rows of a batch output: a slice of the whole batch's buffer.
    let batch = Bytes::from(vec![7u8; 1 << 20]);
    let rows = batch.slice(0..4096);
    let resp = crate::request::InferResponse {
        model_name: "m".into(),
        model_version: 1,
        id: String::new(),
        parameters: Parameters::new(),
        outputs: vec![Tensor { name: "Y".into(), datatype: DataType::Uint8, shape: vec![1, 4096], data: rows.clone() }],
    };
    let entry = Cached::of(&resp);
    assert_eq!(entry.outputs[0].data, rows);
    let held = entry.outputs[0].data.as_ptr_range();
    assert!(!batch.as_ptr_range().contains(&held.start), "the entry copied its rows out of the batch buffer");
    // Dropping the response and the batch leaves only the entry's 4 KB (the buffer's one owner
    // was the batch): try_into_mut succeeds only for a sole owner.
    drop((resp, rows));
    assert!(batch.try_into_mut().is_ok(), "nothing else shares the batch buffer");
}
