use super::*;
use crate::{
    proto::inference::{ModelOutput, ModelParameter},
    tensor::bytes_elements,
};

fn config(params: &[(&str, &str)], outputs: &[(&str, DataType, &[i64])]) -> ModelConfig {
    let mut c = ModelConfig { name: "post".into(), ..Default::default() };
    for (k, v) in params {
        c.parameters.insert(k.to_string(), ModelParameter { string_value: v.to_string() });
    }
    for (name, t, dims) in outputs {
        c.output.push(ModelOutput {
            name: name.to_string(),
            data_type: t.config(),
            dims: dims.to_vec(),
            ..Default::default()
        });
    }
    c
}

fn instance(c: &ModelConfig, folder: &Path) -> Result<Box<dyn ModelInstance>> {
    let path = folder.join("1").join("model.ferry_postprocess");
    PostBackend.load(&InstanceSpec {
        model_path: &path,
        config: c,
        device: crate::backend::Device::Cpu,
        intra_op_threads: 1,
        index: 0,
    })
}

fn le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn i64s(t: &Tensor) -> Vec<i64> {
    t.data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
}

#[test]
fn softmax_on_any_axis_and_sigmoid() {
    let dir = tempfile::tempdir().unwrap();
    let data = le(&[1.0, 2.0, 3.0, 1.0, 1.0, 1.0]);
    let x = [BackendInput { name: "x", datatype: DataType::Fp32, shape: &[2, 3], data: &data, device: &[] }];
    let c = config(&[("operation", "softmax")], &[("y", DataType::Fp32, &[3])]);
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["y"]).unwrap();
    let e = [1f32.exp(), 2f32.exp(), 3f32.exp()];
    let s: f32 = e.iter().sum();
    assert!(close(&f32s(&out[0]), &[e[0] / s, e[1] / s, e[2] / s, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0]));
    assert_eq!(out[0].shape, vec![2, 3]);
    let c = config(&[("operation", "softmax"), ("axis", "0")], &[("y", DataType::Fp32, &[3])]);
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["y"]).unwrap();
    let col = |a: f32, b: f32| a.exp() / (a.exp() + b.exp());
    assert!(close(&f32s(&out[0])[..3], &[col(1.0, 1.0), col(2.0, 1.0), col(3.0, 1.0)]));
    let c = config(&[("operation", "sigmoid")], &[("y", DataType::Fp32, &[3])]);
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["y"]).unwrap();
    assert!((f32s(&out[0])[0] - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
}

#[test]
fn topk_with_labels_and_argmax() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("labels.txt"), "cat\ndog\nfish\nbird\n").unwrap();
    let data = le(&[0.1, 0.7, 0.2, 0.7, 5.0, 1.0, 3.0, 2.0]);
    let x = [BackendInput { name: "logits", datatype: DataType::Fp32, shape: &[2, 4], data: &data, device: &[] }];
    let outputs: &[(&str, DataType, &[i64])] =
        &[("SCORES", DataType::Fp32, &[2]), ("INDICES", DataType::Int64, &[2]), ("LABELS", DataType::Bytes, &[2])];
    let c = config(&[("operation", "topk"), ("k", "2"), ("labels", "labels.txt")], outputs);
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["SCORES", "INDICES", "LABELS"]).unwrap();
    assert_eq!(i64s(&out[1]), vec![1, 3, 0, 2], "ties keep the lower index first");
    assert!(close(&f32s(&out[0]), &[0.7, 0.7, 5.0, 3.0]));
    let labels: Vec<&[u8]> = bytes_elements(&out[2].data).collect::<Result<_>>().unwrap();
    assert_eq!(labels, vec![&b"dog"[..], b"bird", b"cat", b"fish"]);
    assert_eq!(out[2].shape, vec![2, 2]);
    // Only what is asked for comes back.
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["LABELS"]).unwrap();
    assert_eq!(out.len(), 1);
    let c = config(&[("operation", "argmax")], &[("CLASS", DataType::Int32, &[])]);
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["CLASS"]).unwrap();
    assert_eq!(out[0].data.to_vec(), [1i32, 0].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    assert_eq!(out[0].shape, vec![2]);
}

#[test]
fn mean_pooling_follows_the_mask_and_normalizes() {
    let dir = tempfile::tempdir().unwrap();
    // One sentence of 3 tokens, dim 2; the last token is padding.
    let hidden = le(&[1.0, 2.0, 3.0, 4.0, 100.0, 100.0]);
    let mask: Vec<u8> = [1i64, 1, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let x = [
        BackendInput { name: "hidden", datatype: DataType::Fp32, shape: &[1, 3, 2], data: &hidden, device: &[] },
        BackendInput { name: "mask", datatype: DataType::Int64, shape: &[1, 3], data: &mask, device: &[] },
    ];
    let c = config(&[("operation", "pool"), ("normalize", "false")], &[("E", DataType::Fp32, &[2])]);
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["E"]).unwrap();
    assert!(close(&f32s(&out[0]), &[2.0, 3.0]));
    assert_eq!(out[0].shape, vec![1, 2]);
    let c = config(&[("operation", "pool")], &[("E", DataType::Fp32, &[2])]);
    let out = instance(&c, dir.path()).unwrap().execute(&x, &["E"]).unwrap();
    let n = (4.0f32 + 9.0).sqrt();
    assert!(close(&f32s(&out[0]), &[2.0 / n, 3.0 / n]));
    let c = config(&[("operation", "pool"), ("pooling", "cls"), ("normalize", "0")], &[("E", DataType::Fp32, &[2])]);
    assert!(close(&f32s(&instance(&c, dir.path()).unwrap().execute(&x, &["E"]).unwrap()[0]), &[1.0, 2.0]));
    let bad = [
        x[0],
        BackendInput { name: "mask", datatype: DataType::Int64, shape: &[1, 2], data: &mask[..16], device: &[] },
    ];
    let e = instance(&c, dir.path()).unwrap().execute(&bad, &["E"]).unwrap_err().to_string();
    assert!(e.contains("mask 'mask' has shape [1, 2]"), "{e}");
}

#[test]
fn yolo_keeps_the_best_box_of_each_overlap_and_maps_the_letterbox_back() {
    let dir = tempfile::tempdir().unwrap();
    // Channels first, 2 classes, 4 anchors: two overlapping class-0 boxes, one class-1 box on
    // the same spot, one below the confidence.
    let anchors = [
        [50.0, 50.0, 20.0, 20.0, 0.9, 0.1],
        [51.0, 50.0, 20.0, 20.0, 0.8, 0.1],
        [50.0, 50.0, 20.0, 20.0, 0.1, 0.7],
        [10.0, 10.0, 4.0, 4.0, 0.1, 0.2],
    ];
    let mut v = Vec::new();
    for c in 0..6 {
        for a in &anchors {
            v.push(a[c]);
        }
    }
    let data = le(&v);
    let letterbox = le(&[0.5, 0.5, 10.0, 20.0]);
    let x = [
        BackendInput { name: "pred", datatype: DataType::Fp32, shape: &[1, 6, 4], data: &data, device: &[] },
        BackendInput { name: "letterbox", datatype: DataType::Fp32, shape: &[1, 4], data: &letterbox, device: &[] },
    ];
    let outputs: &[(&str, DataType, &[i64])] =
        &[("BOXES", DataType::Fp32, &[-1, 4]), ("SCORES", DataType::Fp32, &[-1]), ("CLASSES", DataType::Int64, &[-1])];
    let c = config(&[("operation", "yolo")], outputs);
    let mut m = instance(&c, dir.path()).unwrap();
    assert!(m.separate_requests());
    let out = m.execute(&x, &["BOXES", "SCORES", "CLASSES"]).unwrap();
    assert_eq!(i64s(&out[2]), vec![0, 1], "the 0.8 box overlaps the 0.9 one of its class");
    assert!(close(&f32s(&out[1]), &[0.9, 0.7]));
    assert!(close(
        &f32s(&out[0])[..4],
        &[(40.0 - 10.0) / 0.5, (40.0 - 20.0) / 0.5, (60.0 - 10.0) / 0.5, (60.0 - 20.0) / 0.5]
    ));
    assert_eq!(out[0].shape, vec![1, 2, 4]);
    let c = config(&[("operation", "yolo"), ("class_aware", "false")], outputs);
    let out = instance(&c, dir.path()).unwrap().execute(&x[..1], &["CLASSES"]).unwrap();
    assert_eq!(i64s(&out[0]), vec![0], "without classes, one box per spot");
}

#[test]
fn bad_parameters_are_load_errors_that_name_them() {
    let dir = tempfile::tempdir().unwrap();
    let out: &[(&str, DataType, &[i64])] = &[("y", DataType::Fp32, &[3])];
    let load_err = |params: &[(&str, &str)], outputs: &[(&str, DataType, &[i64])]| {
        instance(&config(params, outputs), dir.path()).err().map(|e| e.to_string()).unwrap_or_default()
    };
    assert!(load_err(&[], out).contains("parameter 'operation' is required"));
    assert!(
        load_err(&[("operation", "softmaxx")], out).contains("'operation' is 'softmaxx'; expected one of: softmax")
    );
    assert!(load_err(&[("operation", "topk"), ("k", "0")], out).contains("'k' is '0'"));
    assert!(load_err(&[("operation", "topk"), ("labels", "../etc/passwd")], out).contains("parameter 'labels'"));
    assert!(load_err(&[("operation", "topk"), ("tpo_k", "3")], out).contains("'tpo_k' is not one this backend reads"));
    assert!(load_err(&[("operation", "argmax")], out).contains("argmax expects one TYPE_INT64"));
    assert!(load_err(&[("operation", "yolo")], out).contains("yolo expects two TYPE_FP32 outputs"));
}
