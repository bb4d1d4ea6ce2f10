//! Wire compatibility across machines: every kind of frame, encoded here, must be
//! byte for byte the frame in `tests/golden/frames.txt`, and every frame there must decode to the
//! same message. CI runs this on x86-64 and, cross-built, on aarch64 under qemu-user, so a frame
//! encoded on either decodes on the other (both agree with one file). Tensors cover every dtype
//! with values whose half-precision rounding is exact, ties and subnormal.
//!
//! A deliberate change of the protocol updates the file: `RINGTMP_BLESS=1 cargo test -p
//! ringtmp-wire --test golden` (and bumps `PROTOCOL_VERSION`).

use ringtmp_wire::message::tensor_bytes;
use ringtmp_wire::{Control, Dtype, Limits, Message, NodeAddr, TensorHeader, TensorTag};

/// One message of every control kind and every tensor dtype, with fixed contents.
#[expect(
    clippy::too_many_lines,
    reason = "one golden message per variant of the wire's enum"
)]
fn messages() -> Vec<(&'static str, Message)> {
    let node = |rank, addr: &str| NodeAddr {
        rank,
        addr: addr.into(),
    };
    let controls = vec![
        (
            "abort",
            Control::Abort {
                origin: 3,
                reason: "peer 2 timed out — état".into(),
            },
        ),
        (
            "checkpoint",
            Control::Checkpoint {
                step: 120,
                files: vec!["{\"a\":1}".into(), String::new()],
            },
        ),
        ("goodbye", Control::Goodbye),
        ("heartbeat", Control::Heartbeat { seq: 0 }),
        (
            "hello",
            Control::Hello {
                run_id: 0x0123_4567_89ab_cdef,
                rank: 1,
                nonce: [0xa5; 32],
                encrypted: true,
                aes: true,
            },
        ),
        ("ping", Control::Ping { seq: 300 }),
        ("pong", Control::Pong { seq: 65_537 }),
        (
            "proof",
            Control::Proof {
                mac: std::array::from_fn(|i| i as u8),
            },
        ),
        (
            "register",
            Control::Register {
                node: node(2, "10.0.0.2:4100"),
                world_size: 3,
            },
        ),
        (
            "regroup",
            Control::Regroup {
                generation: 2,
                members: vec![0, 2, 3],
                step: 17,
                optimizer_steps: 16,
            },
        ),
        (
            "report",
            Control::Report {
                nodes: vec!["{}".into()],
            },
        ),
        (
            "table",
            Control::Table {
                run_id: 42,
                nodes: vec![node(0, "[::1]:5000"), node(1, "127.0.0.1:6000")],
                settings: "{\"job\":\"selftest\"}".into(),
            },
        ),
        (
            "profile-request",
            Control::ProfileRequest {
                request: "{\"rows\":64}".into(),
            },
        ),
        (
            "profile",
            Control::Profile {
                rank: 1,
                report: "{\"layer_seconds\":[0.001]}".into(),
            },
        ),
        (
            "strategy",
            Control::Strategy {
                strategy: "ring".into(),
                kind: "GradNorm".into(),
                payload: vec![0, 41, 0x80, 0x01],
            },
        ),
        (
            "refused",
            Control::Refused {
                reason: "rank 1 is taken".into(),
            },
        ),
        ("table-received", Control::TableReceived { rank: 2 }),
        ("start", Control::Start),
    ];
    for (_, c) in &controls {
        // Fails to compile when a kind is added without a golden frame here.
        match c {
            Control::Abort { .. }
            | Control::Checkpoint { .. }
            | Control::Goodbye
            | Control::Heartbeat { .. }
            | Control::Hello { .. }
            | Control::Ping { .. }
            | Control::Pong { .. }
            | Control::Proof { .. }
            | Control::Register { .. }
            | Control::Regroup { .. }
            | Control::Report { .. }
            | Control::Table { .. }
            | Control::ProfileRequest { .. }
            | Control::Profile { .. }
            | Control::Strategy { .. }
            | Control::Refused { .. }
            | Control::TableReceived { .. }
            | Control::Start => {}
        }
    }
    let mut all: Vec<(&'static str, Message)> = controls
        .into_iter()
        .map(|(name, c)| (name, Message::Control(c)))
        .collect();
    // 1 + 2^-11 is a tie in f16 (rounds to even), 1e-6 is subnormal there, 3.3 rounds.
    let values = [
        0.0f32,
        -0.0,
        1.0,
        -2.5,
        1.0 + 1.0 / 2048.0,
        1e-6,
        3.3,
        65504.0,
        -1e30,
    ];
    let tags = [
        TensorTag::Activation,
        TensorTag::Gradient,
        TensorTag::Inference,
        TensorTag::Params,
        TensorTag::ParamGrads,
        TensorTag::Probe,
    ];
    for (i, (name, dtype)) in [
        ("tensor-f32", Dtype::F32),
        ("tensor-f16", Dtype::F16),
        ("tensor-bf16", Dtype::Bf16),
    ]
    .into_iter()
    .enumerate()
    {
        let header = TensorHeader {
            run_id: 9,
            step: 3 + i as u64,
            micro_batch: 1,
            tag: tags[i],
            dtype,
            shape: vec![3, 3],
        };
        all.push((name, Message::Tensor(header, tensor_bytes(&values, dtype))));
    }
    for (i, tag) in tags.iter().enumerate().skip(3) {
        let header = TensorHeader {
            run_id: 9,
            step: 0,
            micro_batch: i as u64,
            tag: *tag,
            dtype: Dtype::F32,
            shape: vec![],
        };
        let name = [
            "",
            "",
            "",
            "tensor-params",
            "tensor-param-grads",
            "tensor-probe",
        ][i];
        all.push((
            name,
            Message::Tensor(header, tensor_bytes(&[7.5], Dtype::F32)),
        ));
    }
    all
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("golden file: not hex"))
        .collect()
}

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/frames.txt");

#[test]
fn every_frame_matches_the_golden_bytes_and_decodes_from_them() {
    let encoded: Vec<(&str, Message, Vec<u8>)> = messages()
        .into_iter()
        .map(|(name, m)| {
            let mut buf = Vec::new();
            ringtmp_wire::encode(&m, &mut buf);
            (name, m, buf)
        })
        .collect();
    if std::env::var_os("RINGTMP_BLESS").is_some() {
        let text: String = encoded
            .iter()
            .map(|(name, _, bytes)| format!("{name} {}\n", hex(bytes)))
            .collect();
        std::fs::write(GOLDEN, text).expect("writing the golden file");
    }
    let golden = std::fs::read_to_string(GOLDEN).expect("reading tests/golden/frames.txt");
    let lines: Vec<(&str, &str)> = golden
        .lines()
        .map(|l| l.split_once(' ').expect("golden file: NAME HEX per line"))
        .collect();
    assert_eq!(
        lines.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        encoded.iter().map(|(n, _, _)| *n).collect::<Vec<_>>(),
        "the golden file lists other frames (RINGTMP_BLESS=1 rewrites it)"
    );
    for ((name, hex_text), (_, message, bytes)) in lines.iter().zip(&encoded) {
        let want = unhex(hex_text);
        assert_eq!(
            hex(bytes),
            *hex_text,
            "{name}: encoded differently on this machine"
        );
        let (back, used) = ringtmp_wire::decode(&want, &Limits::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .unwrap_or_else(|| panic!("{name}: incomplete"));
        assert_eq!(used, want.len(), "{name}");
        assert_eq!(
            &back, message,
            "{name}: decoded differently on this machine"
        );
    }
}

// The half-precision conversions in particular: what the golden tensors hold, value by value.
#[test]
fn half_precision_values_round_the_same_everywhere() {
    let values = [1.0f32 + 1.0 / 2048.0, 1e-6, 3.3, 65504.0, -1e30];
    let f16: Vec<u16> = values
        .iter()
        .map(|v| half::f16::from_f32(*v).to_bits())
        .collect();
    let bf16: Vec<u16> = values
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect();
    assert_eq!(f16, [0x3c00, 0x0011, 0x429a, 0x7bff, 0xfc00]);
    assert_eq!(bf16, [0x3f80, 0x3586, 0x4053, 0x4780, 0xf14a]);
}
