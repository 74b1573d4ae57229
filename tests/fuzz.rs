//! Fuzzing on stable Rust: every decoder a client or a bucket reaches (KServe JSON and binary
//! bodies, the gRPC request converter, config.pbtxt, Vertex AI instances, the response-cache
//! codec, the image step's decoders and resampling, the tokenizer step both ways) and the
//! shared-memory bookkeeping get mutated seed inputs. None may panic, and none may
//! allocate more than its declared bound (a multiple of the input plus a constant), measured by a
//! counting allocator. `FERRY_FUZZ_ITERS` sets the runs per target (CI: the default; longer runs:
//! bench/fuzz.sh). A failure prints the input that caused it.
use std::{
    alloc::{GlobalAlloc, Layout, System},
    panic::{AssertUnwindSafe, catch_unwind},
    sync::atomic::{AtomicUsize, Ordering},
};

use bytes::Bytes;

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// The counters are the process's: one fuzz test at a time, or one's allocations count for the
/// other's.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        if new > layout.size() {
            let now = CURRENT.fetch_add(new - layout.size(), Ordering::Relaxed) + new - layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        } else {
            CURRENT.fetch_sub(layout.size() - new, Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A small deterministic generator (xorshift), so a failure reproduces from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: &[&[u8]] = &[
    b"0",
    b"-1",
    b"4294967295",
    b"18446744073709551616",
    b"1e308",
    b"\"",
    b"[",
    b"]",
    b"{",
    b"}",
    b",",
    b":",
    b"null",
    b"true",
    b"\\u0000",
    b"\xff",
    b"\x00",
    b"99999999999",
    b"-9223372036854775808",
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut v = seeds[rng.below(seeds.len())].clone();
    for _ in 0..=rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(7) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.insert(at, rng.next() as u8),
            2 if !v.is_empty() => {
                let end = (at + rng.below(16)).min(v.len());
                v.drain(at.min(end)..end);
            }
            3 => {
                let t = INTERESTING[rng.below(INTERESTING.len())];
                v.splice(at..at, t.iter().copied());
            }
            4 if !v.is_empty() => {
                let (a, b) = (rng.below(v.len()), rng.below(v.len()));
                let part = v[a.min(b)..a.max(b)].to_vec();
                v.splice(at.min(v.len())..at.min(v.len()), part);
            }
            5 => v.truncate(at),
            _ => {
                let other = &seeds[rng.below(seeds.len())];
                let cut = rng.below(other.len() + 1);
                v.truncate(at);
                v.extend_from_slice(&other[cut..]);
            }
        }
    }
    v
}

fn iterations() -> usize {
    std::env::var("FERRY_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(3000)
}

/// Runs `target` on mutated seeds: no panic, and at most `bound(input)` bytes allocated above
/// what was live before the call.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, bound: impl Fn(&[u8]) -> usize, mut target: impl FnMut(&[u8])) {
    let mut rng = Rng(0x5eed_f00d ^ name.len() as u64);
    let mut worst = 0usize;
    for i in 0..iterations() {
        let input = if i < seeds.len() { seeds[i].clone() } else { mutate(&mut rng, &seeds) };
        let before = CURRENT.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let outcome = catch_unwind(AssertUnwindSafe(|| target(&input)));
        let used = PEAK.load(Ordering::Relaxed).saturating_sub(before);
        let shown = String::from_utf8_lossy(&input[..input.len().min(400)]).to_string();
        assert!(outcome.is_ok(), "{name}: panic on input {shown:?}");
        let allowed = bound(&input);
        assert!(used <= allowed, "{name}: allocated {used} bytes (bound {allowed}) on input {shown:?}");
        worst = worst.max(used);
    }
    eprintln!("{name}: {} inputs, no panic, at most {worst} bytes allocated", iterations());
}

fn kserve_seeds() -> Vec<Vec<u8>> {
    vec![
        br#"{"id":"1","inputs":[{"name":"INPUT0","shape":[1,4],"datatype":"INT32","data":[1,2,3,4]}],"outputs":[{"name":"OUTPUT0"}]}"#.to_vec(),
        br#"{"inputs":[{"name":"s","shape":[2],"datatype":"BYTES","data":["a","b"]}],"parameters":{"priority":1,"timeout":5}}"#.to_vec(),
        br#"{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}],"outputs":[{"name":"y","parameters":{"binary_data":true,"classification":2}}]}"#.to_vec(),
        br#"{"inputs":[{"name":"x","shape":[2,2],"datatype":"FP16","data":[[1.5,2],[3,4]]}]}"#.to_vec(),
    ]
}

#[test]
fn fuzz_every_decoder() {
    let _alone = alone();
    let shm = ferry::shm::SharedMemory::new(false);
    // KServe JSON, and the binary extension (the header length from the input's last byte).
    fuzz(
        "kserve json/binary",
        kserve_seeds(),
        |i| 64 * i.len() + (1 << 20),
        |input| {
            let header_len = input.last().map(|&b| b as usize * 2).filter(|&n| n <= input.len());
            let _ = ferry::frontend::json::decode("m", None, Bytes::copy_from_slice(input), None, &shm);
            let _ = ferry::frontend::json::decode("m", Some(1), Bytes::copy_from_slice(input), header_len, &shm);
        },
    );

    // gRPC: random wire bytes decoded as a ModelInferRequest, then converted.
    let grpc_seeds: Vec<Vec<u8>> = {
        use ferry::proto::inference::{ModelInferRequest, model_infer_request::InferInputTensor};
        use prost::Message;
        let r = ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![InferInputTensor {
                name: "x".into(),
                datatype: "INT32".into(),
                shape: vec![1, 2],
                ..Default::default()
            }],
            raw_input_contents: vec![Bytes::from_static(&[1, 0, 0, 0, 2, 0, 0, 0])],
            ..Default::default()
        };
        vec![r.encode_to_vec(), ModelInferRequest::default().encode_to_vec()]
    };
    fuzz(
        "grpc convert",
        grpc_seeds,
        |i| 32 * i.len() + (1 << 20),
        |input| {
            use prost::Message;
            if let Ok(r) = ferry::proto::inference::ModelInferRequest::decode(input) {
                let _ = ferry::frontend::grpc::convert::request(r, &shm);
            }
        },
    );

    // config.pbtxt, from the examples' configs.
    let configs: Vec<Vec<u8>> = ["simple", "simple_string", "text_classifier", "text_classifier_pre"]
        .iter()
        .map(|m| std::fs::read(format!("{}/examples/{m}/config.pbtxt", env!("CARGO_MANIFEST_DIR"))).unwrap())
        .collect();
    fuzz(
        "config.pbtxt",
        configs,
        |i| 256 * i.len() + (4 << 20),
        |input| {
            let _ = ferry::proto::pbtxt::parse(&String::from_utf8_lossy(input));
        },
    );

    // Vertex AI instances against a model with INT32 [4] and BYTES [1] inputs.
    let meta = vec![
        ferry::engine::TensorMetadata {
            name: "a".into(),
            datatype: ferry::tensor::DataType::Int32,
            shape: vec![-1, 4],
        },
        ferry::engine::TensorMetadata {
            name: "s".into(),
            datatype: ferry::tensor::DataType::Bytes,
            shape: vec![-1, 1],
        },
    ];
    let instances = vec![
        br#"{"instances":[{"a":[1,2,3,4],"s":["x"]},{"a":[5,6,7,8],"s":["y"]}],"parameters":{"k":1}}"#.to_vec(),
        br#"{"instances":[[1,2,3,4]]}"#.to_vec(),
    ];
    fuzz(
        "vertex instances",
        instances,
        |i| 64 * i.len() + (1 << 20),
        |input| {
            let _ = ferry::frontend::instances::requests("m", input, &meta, 4);
            let _ = ferry::frontend::instances::requests("m", input, &meta, 0);
        },
    );

    // The response cache's entries (a shared Redis holds what any replica wrote).
    let cached = ferry::cache::Cached {
        parameters: [("p".to_string(), ferry::request::ParamValue::Int(3))].into(),
        outputs: vec![ferry::tensor::Tensor {
            name: "y".into(),
            datatype: ferry::tensor::DataType::Fp32,
            shape: vec![1, 2],
            data: Bytes::from_static(&[0; 8]),
        }],
    };
    fuzz(
        "cache codec",
        vec![ferry::cache::codec::encode(&cached)],
        |i| 8 * i.len() + (64 << 10),
        |input| {
            let _ = ferry::cache::codec::decode(Bytes::copy_from_slice(input));
        },
    );

    // The image step (ferry_image): every format it decodes, then resize, crop and normalise;
    // max_pixels small, so a header that claims a huge image is refused before decoding; small
    // outputs (the seeds are scaled up, a mutated header's larger image down).
    let mut step = image_step("imagenet", 40, &[("size", "48"), ("crop", "40"), ("max_pixels", "1048576")]);
    let mut letterbox = image_step("yolo", 32, &[("size", "32"), ("max_pixels", "1048576")]);
    let jpeg = {
        let mut d = Vec::new();
        ferry::tensor::push_bytes_element(&mut d, &image_seeds()[0]);
        d
    };
    let seed = ferry::backend::BackendInput {
        name: "IMAGE",
        datatype: ferry::tensor::DataType::Bytes,
        shape: &[1],
        data: &jpeg,
        device: &[],
    };
    assert_eq!(step.execute(std::slice::from_ref(&seed), &["PIXELS"]).unwrap()[0].shape, [3, 40, 40]);
    assert_eq!(letterbox.execute(&[seed], &["PIXELS", "MAPPING"]).unwrap()[1].shape, [4]);
    fuzz(
        "image step",
        image_seeds(),
        // The decoder's allocation limit (64 MiB at the least) plus the step's own buffers.
        |i| 2 * i.len() + (80 << 20),
        |input| {
            let mut data = Vec::new();
            ferry::tensor::push_bytes_element(&mut data, input);
            let shape = [1i64];
            let image = ferry::backend::BackendInput {
                name: "IMAGE",
                datatype: ferry::tensor::DataType::Bytes,
                shape: &shape,
                data: &data,
                device: &[],
            };
            let _ = step.execute(std::slice::from_ref(&image), &["PIXELS"]);
            let _ = letterbox.execute(&[image], &["PIXELS", "MAPPING"]);
        },
    );

    // The tokenizer step (ferry_tokenizer): texts (split at NUL into a batch; any bytes, so also
    // text that is not UTF-8), sentence pairs, and token ids back to text (ids past the vocabulary).
    let folder = std::env::temp_dir().join(format!("ferry-fuzz-tokenizer-{}", std::process::id()));
    let (mut encode, mut pairs, mut decode) = (
        tokenizer_step(&folder, &[("padding", "max_length"), ("max_length", "24")], 1, "input_ids"),
        tokenizer_step(&folder, &[("max_length", "24")], 2, "input_ids"),
        tokenizer_step(&folder, &[("direction", "decode")], 1, "TEXT_OUT"),
    );
    // The steps work on their seeds (so the mutations exercise real encodes and decodes).
    let hello = {
        let mut d = Vec::new();
        ferry::tensor::push_bytes_element(&mut d, b"hello world");
        d
    };
    let text = ferry::backend::BackendInput {
        name: "TEXT",
        datatype: ferry::tensor::DataType::Bytes,
        shape: &[1],
        data: &hello,
        device: &[],
    };
    let ids = &encode.execute(&[text], &["input_ids"]).unwrap()[0];
    let ids: Vec<i64> = ids.data.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(ids, [[2, 4, 5, 3].as_slice(), &[0; 20]].concat());
    let back: Vec<u8> = [2i64, 4, 5, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let ids = ferry::backend::BackendInput {
        name: "IDS",
        datatype: ferry::tensor::DataType::Int64,
        shape: &[1, 4],
        data: &back,
        device: &[],
    };
    assert_eq!(&decode.execute(&[ids], &["TEXT_OUT"]).unwrap()[0].data[4..], b"hello world");
    fuzz(
        "tokenizer step",
        vec![
            b"hello world".to_vec(),
            "na\u{ef}ve caf\u{e9} \u{6771}\u{4eac}\0The quick brown fox".as_bytes().to_vec(),
            b"\0\0[CLS] hello [SEP] [PAD]".to_vec(),
        ],
        |i| 64 * i.len() + (1 << 20),
        |input| {
            let texts: Vec<&[u8]> = input.split(|&b| b == 0).collect();
            let mut data = Vec::new();
            texts.iter().for_each(|t| ferry::tensor::push_bytes_element(&mut data, t));
            let shape = [texts.len() as i64];
            let text = |name| ferry::backend::BackendInput {
                name,
                datatype: ferry::tensor::DataType::Bytes,
                shape: &shape,
                data: &data,
                device: &[],
            };
            let _ = encode.execute(&[text("TEXT")], &["input_ids", "attention_mask", "token_type_ids"]);
            let _ = pairs.execute(&[text("TEXT"), text("TEXT_PAIR")], &["input_ids", "token_type_ids"]);
            let ids: Vec<u8> = input.iter().flat_map(|&b| i64::from(b).to_le_bytes()).collect();
            let rows = [1, input.len() as i64];
            let ids = ferry::backend::BackendInput {
                name: "IDS",
                datatype: ferry::tensor::DataType::Int64,
                shape: &rows,
                data: &ids,
                device: &[],
            };
            let _ = decode.execute(&[ids], &["TEXT_OUT"]);
        },
    );
    let _ = std::fs::remove_dir_all(&folder);

    // Shared-memory bookkeeping: random registrations, reads and writes on a real object.
    let key = format!("ferry-fuzz-{}", std::process::id());
    std::fs::write(format!("/dev/shm/{key}"), vec![0u8; 4096]).unwrap();
    let shm = ferry::shm::SharedMemory::new(true);
    let ops: Vec<Vec<u8>> = vec![(0u8..32).collect()];
    fuzz(
        "shared memory",
        ops,
        |_| 1 << 20,
        |input| {
            let n = |i: usize| input.get(i).copied().unwrap_or(0) as u64;
            let (offset, size) = (n(0) * 64 + n(1), n(2) * 64 + n(3));
            let name = if n(4) % 2 == 0 { "a" } else { "b" };
            let _ = shm.register(name, &key, offset, size);
            let _ = shm.read(name, n(5) * 16, n(6) * 16);
            let _ = shm.write(name, n(7), n(8) * 8, "o", &input[..input.len().min(64)]);
            if n(9) % 3 == 0 {
                let _ = shm.unregister(Some(name));
            }
        },
    );
    let _ = std::fs::remove_file(format!("/dev/shm/{key}"));
}

/// What a config makes the server build before any request (its validation, schema, queue and
/// batching policies), on mutated configs with hostile values (priority levels, instance
/// counts, warm-up sizes); and the message protocol a Python process speaks (framing with
/// announced lengths, tensor descriptions), on mutated messages.
#[test]
fn fuzz_configs_and_the_python_protocol() {
    let _alone = alone();
    let hostile = br#"name: "m" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 priority_levels: 4
  default_priority_level: 2 default_queue_policy { max_queue_size: 8 default_timeout_microseconds: 100 }
  priority_queue_policy { key: 1 value { timeout_action: DELAY } } }
model_warmup [ { name: "w" batch_size: 8 count: 3 inputs { key: "x" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } } ]
"#;
    let sequence = br#"name: "s" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching { max_sequence_idle_microseconds: 1000 oldest { max_candidate_sequences: 4 }
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "A" output_name: "B" data_type: TYPE_FP32 dims: [ 16 ] } ] }
"#;
    for seed in [&hostile[..], &sequence[..]] {
        let mut config = ferry::proto::pbtxt::parse(std::str::from_utf8(seed).unwrap()).unwrap();
        ferry::repository::config::normalize(&mut config);
        ferry::repository::config::validate(&config).unwrap();
    }
    fuzz(
        "config values",
        vec![hostile.to_vec(), sequence.to_vec()],
        |i| 512 * i.len() + (8 << 20),
        |input| {
            let Ok(mut config) = ferry::proto::pbtxt::parse(&String::from_utf8_lossy(input)) else { return };
            ferry::repository::config::normalize(&mut config);
            if ferry::repository::config::validate(&config).is_err() {
                return;
            }
            let Ok(schema) = ferry::schema::Schema::from_config(&config, Vec::new()) else { return };
            let dynamic = match &config.scheduling_choice {
                Some(ferry::proto::inference::model_config::SchedulingChoice::DynamicBatching(d)) => Some(d),
                _ => None,
            };
            let _ = ferry::scheduler::QueuePolicy::new(dynamic);
            let _ = ferry::scheduler::BatchPolicy::new(schema.max_batch_size, dynamic);
        },
    );

    // Python messages: length-prefixed JSON, a blob count, then each blob with its length.
    let message = |json: &str, blobs: &[&[u8]]| {
        let mut m = Vec::new();
        m.extend((json.len() as u32).to_le_bytes());
        m.extend(json.as_bytes());
        m.extend((blobs.len() as u32).to_le_bytes());
        for b in blobs {
            m.extend((b.len() as u64).to_le_bytes());
            m.extend(*b);
        }
        m
    };
    let seeds = vec![
        message(
            r#"{"op":"response","handle":1,"final":false,"outputs":[{"name":"y","datatype":"FP32","shape":[1,2]}]}"#,
            &[&[0; 8]],
        ),
        message(r#"{"op":"done","responses":[[[["y","INT32",[2],0,8]],null,{}]],"region":["r",64]}"#, &[]),
        [message(r#"{"op":"log","level":"INFO","message":"hi"}"#, &[]), message(r#"{"op":"cancelled"}"#, &[b"x"])]
            .concat(),
    ];
    fuzz(
        "python protocol",
        seeds,
        // Bytes are allocated as they arrive, never as announced.
        |i| 64 * i.len() + (2 << 20),
        |input| {
            let mut reader = input;
            while let Ok((msg, blobs)) = ferry::backend::python::read_message(&mut reader) {
                let _ = ferry::backend::python::tensors(&msg["outputs"], blobs);
            }
        },
    );
}

/// A ferry_image instance: a preset, its output `size` square, and parameters over the preset's.
fn image_step(preset: &str, size: i64, params: &[(&str, &str)]) -> Box<dyn ferry::backend::ModelInstance> {
    use ferry::backend::Backend;
    use ferry::proto::inference::{ModelConfig, ModelInput, ModelOutput, ModelParameter};
    let param = |v: &str| ModelParameter { string_value: v.into() };
    let config = ModelConfig {
        name: format!("fuzz_{preset}"),
        backend: "ferry_image".into(),
        parameters: params.iter().chain(&[("preset", preset)]).map(|(k, v)| (k.to_string(), param(v))).collect(),
        input: vec![ModelInput { name: "IMAGE".into(), data_type: 13, dims: vec![1], ..Default::default() }],
        output: vec![
            ModelOutput { name: "PIXELS".into(), data_type: 11, dims: vec![3, size, size], ..Default::default() },
            ModelOutput { name: "MAPPING".into(), data_type: 11, dims: vec![4], ..Default::default() },
        ],
        ..Default::default()
    };
    let spec = ferry::backend::InstanceSpec {
        model_path: std::path::Path::new("."),
        config: &config,
        device: ferry::backend::Device::Cpu,
        intra_op_threads: 1,
        index: 0,
    };
    ferry::backend::native::image::ImageBackend.load(&spec).unwrap()
}

/// A small picture in every format the image step decodes, and base64 text of one.
fn image_seeds() -> Vec<Vec<u8>> {
    use base64::Engine as _;
    let picture =
        image::RgbImage::from_fn(24, 16, |x, y| image::Rgb([(x * 10) as u8, (y * 15) as u8, ((x * y) % 256) as u8]));
    let mut seeds: Vec<Vec<u8>> = [
        image::ImageFormat::Jpeg,
        image::ImageFormat::Png,
        image::ImageFormat::WebP,
        image::ImageFormat::Bmp,
        image::ImageFormat::Gif,
    ]
    .into_iter()
    .map(|format| {
        let mut out = std::io::Cursor::new(Vec::new());
        image::DynamicImage::ImageRgb8(picture.clone()).write_to(&mut out, format).unwrap();
        out.into_inner()
    })
    .collect();
    seeds.push(base64::engine::general_purpose::STANDARD.encode(&seeds[1]).into_bytes());
    seeds
}

/// A ferry_tokenizer instance over a small WordPiece tokenizer (BERT's normaliser, pre-tokeniser,
/// `[CLS] A [SEP] B [SEP]`), written to `folder`: `texts` text inputs, or ids with `decode`.
fn tokenizer_step(
    folder: &std::path::Path,
    params: &[(&str, &str)],
    texts: usize,
    output: &str,
) -> Box<dyn ferry::backend::ModelInstance> {
    use ferry::backend::Backend;
    use ferry::proto::inference::{ModelConfig, ModelInput, ModelOutput, ModelParameter};
    use tokenizers::{
        AddedToken, Tokenizer, decoders::wordpiece::WordPiece as Pieces, models::wordpiece::WordPiece,
        normalizers::BertNormalizer, pre_tokenizers::bert::BertPreTokenizer, processors::template::TemplateProcessing,
    };
    let words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "the", "quick", "brown", "fox", "##s", "##e"];
    std::fs::create_dir_all(folder.join("1")).unwrap();
    let vocab = folder.join("vocab.txt");
    std::fs::write(&vocab, words.join("\n")).unwrap();
    let model = WordPiece::from_file(&vocab.to_string_lossy()).unk_token("[UNK]".into()).build().unwrap();
    let mut tokenizer = Tokenizer::new(model);
    tokenizer.with_normalizer(Some(BertNormalizer::default())).unwrap();
    tokenizer.with_pre_tokenizer(Some(BertPreTokenizer));
    tokenizer.with_decoder(Some(Pieces::default()));
    let template = TemplateProcessing::builder()
        .try_single("[CLS] $A [SEP]")
        .unwrap()
        .try_pair("[CLS] $A [SEP] $B:1 [SEP]:1")
        .unwrap()
        .special_tokens(vec![("[CLS]", 2), ("[SEP]", 3)])
        .build()
        .unwrap();
    tokenizer.with_post_processor(Some(template));
    tokenizer.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"].map(|t| AddedToken::from(t, true))).unwrap();
    std::fs::write(folder.join("1").join("tokenizer.json"), tokenizer.to_string(false).unwrap()).unwrap();

    let param = |v: &str| ModelParameter { string_value: v.into() };
    let decode = output == "TEXT_OUT";
    let input =
        |name: &str, data_type| ModelInput { name: name.into(), data_type, dims: vec![-1], ..Default::default() };
    let config = ModelConfig {
        name: "fuzz_tokenizer".into(),
        backend: "ferry_tokenizer".into(),
        parameters: params.iter().map(|(k, v)| (k.to_string(), param(v))).collect(),
        // TYPE_STRING 13, TYPE_INT64 9.
        input: if decode {
            vec![input("IDS", 9)]
        } else {
            ["TEXT", "TEXT_PAIR"][..texts].iter().map(|n| input(n, 13)).collect()
        },
        output: if decode {
            vec![ModelOutput { name: output.into(), data_type: 13, dims: vec![-1], ..Default::default() }]
        } else {
            ["input_ids", "attention_mask", "token_type_ids"]
                .iter()
                .map(|n| ModelOutput { name: n.to_string(), data_type: 9, dims: vec![-1], ..Default::default() })
                .collect()
        },
        ..Default::default()
    };
    let spec = ferry::backend::InstanceSpec {
        model_path: &folder.join("1").join("model"),
        config: &config,
        device: ferry::backend::Device::Cpu,
        intra_op_threads: 1,
        index: 0,
    };
    ferry::backend::native::tokenizer::TokenizerBackend.load(&spec).unwrap()
}
