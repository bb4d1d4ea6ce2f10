//! Generation over a ring against one process: a GPT trained and checkpointed by `local`, then
//! generated from with its layers split over 2 and 3 nodes (on loopback links and on the
//! simulated network), draws exactly the tokens the whole model draws in one process for the
//! same prompt and seed — greedy and sampled, through refills of the context.

use ringtmp_model::generate::{LocalChain, Sampling, generate};
use ringtmp_model::{Stage, checkpoint};
use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::generate::{GenerateJob, model_layers, partition, run, tail_of};
use ringtmp_testkit::fixtures::{gpt, text_data, train_config};
use ringtmp_testkit::nodes::{Backend, ring, run_nodes};
use ringtmp_testkit::oracle;
use ringtmp_transport::sim::test_seed;

#[test]
fn a_split_generation_draws_the_tokens_of_one_process() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, text) = text_data(tmp.path());
    let out = tmp.path().join("local");
    let cfg = TrainConfig {
        dataset: "text".into(),
        text: Some(text),
        source: None,
        init_from: None,
        checkpoint_every: 20,
        ..train_config(gpt(data.classes, 16), 8, 20, &out)
    };
    oracle::local_params(&cfg, &data);
    let dir = checkpoint::resolve(&out).unwrap();
    let manifest = checkpoint::read_manifest(&dir).unwrap();
    let context = checkpoint::context_of(&dir, &manifest).unwrap().unwrap();
    let layers = model_layers(&dir, context, data.classes).unwrap();
    let prompt = vec![3, 1, 4];
    for (temperature, top_k) in [(0.0, 0), (1.0, 5)] {
        // 30 tokens in a context of 8: the context refills several times.
        let sampling = Sampling::top_k(temperature, top_k, 11);
        let mut whole = Stage::new(&layers, 0..layers.len(), manifest.seed, 1);
        checkpoint::read_params(&dir, &manifest, &mut whole).unwrap();
        let mut chain = LocalChain::new(vec![whole]).unwrap();
        let one = generate(&mut chain, &prompt, 30, &sampling, &mut |_| Ok(()))
            .unwrap()
            .tokens;
        for (nodes, backend) in [(2, Backend::Tcp), (3, Backend::sim(test_seed(12)))] {
            let job = GenerateJob {
                checkpoint: dir.clone(),
                pretrained: false,
                partition: partition(&layers, nodes).unwrap(),
                context,
                vocab: data.classes,
                prompt: prompt.clone(),
                tokens: 30,
                temperature,
                top_k,
                top_p: 1.0,
                seed: 11,
                stop: Vec::new(),
                print_prompt: true,
                threads: 1,
                recv_timeout_secs: 30.0,
                tokenizer: None,
                weights_dtype: Default::default(),
                activations: None,
                tail: None,
            };
            job.validate(nodes as u32).unwrap();
            let ran = run_nodes(&backend, ring(nodes as u32), None, |rank, net| {
                let mut drawn = Vec::new();
                let out = match run(&job, rank, net, &mut |t| {
                    drawn.push(t);
                    Ok(())
                }) {
                    Ok(out) => {
                        net.close().map_err(|e| e.to_string())?;
                        out
                    }
                    Err(e) => {
                        net.abort(&e.to_string());
                        return Err(e.to_string());
                    }
                };
                Ok::<_, String>((out.map(|(g, _)| g.tokens), drawn))
            });
            let mut results = ran.results.into_iter();
            let (tokens, streamed) = results.next().unwrap().unwrap();
            for other in results {
                assert_eq!(other.unwrap(), (None, Vec::new()), "only rank 0 draws");
            }
            let tokens = tokens.expect("rank 0 returns the tokens");
            assert_eq!(tokens, streamed, "every token handed on as drawn");
            assert_eq!(
                tokens,
                one,
                "{nodes} nodes ({}), temperature {temperature}",
                backend.name()
            );
        }
    }
}

/// A pretrained model (the tiny Qwen 3 of `benches/reference/pretrained`, and the Llama whose
/// head is tied to its embedding, which rank 0 then runs beside its table) split over 3 nodes
/// on the simulated network, each reading its own layers from the model's files: the tokens
/// of one process, sampled with top-k and top-p, ending at a stop token exactly where one
/// process ends.
#[test]
fn a_split_pretrained_model_draws_the_tokens_of_one_process_and_stops_with_it() {
    for name in ["qwen3", "llama-tied"] {
        split_pretrained_draws_as_one_process(name);
    }
}

fn split_pretrained_draws_as_one_process(name: &str) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/reference/pretrained")
        .join(name);
    let model = ringtmp_pretrained::model::Pretrained::open(&dir).unwrap();
    let context = model.config.context;
    let layers = model.layers(context).unwrap();
    let mut whole = Stage::new(&layers, 0..layers.len(), 0, 1);
    model
        .load(&layers, 0..layers.len(), whole.params_mut())
        .unwrap();
    whole.sync_tie();
    let mut chain = LocalChain::new(vec![whole]).unwrap();
    let prompt = vec![5, 17, 99];
    let free = Sampling {
        top_p: 0.9,
        ..Sampling::top_k(1.0, 40, 3)
    };
    let drawn = generate(&mut chain, &prompt, 40, &free, &mut |_| Ok(()))
        .unwrap()
        .tokens;
    // The fifth token drawn becomes a stop token: generation ends before it.
    let stop = drawn[4];
    let first = drawn.iter().position(|&t| t == stop).unwrap();
    let sampling = Sampling {
        stop: vec![stop],
        ..free.clone()
    };
    let one = generate(&mut chain, &prompt, 40, &sampling, &mut |_| Ok(())).unwrap();
    assert_eq!(one.tokens, drawn[..first]);
    assert_eq!(one.stopped_at, Some(stop));
    let nodes = 3;
    // A head tied to the embedding runs on rank 0, beside the table it reads.
    let tail = tail_of(&layers, nodes);
    assert_eq!(
        tail.is_some(),
        layers.last().unwrap().tied_to.is_some(),
        "{name}"
    );
    let ring_layers = tail.map_or(layers.len(), |t| t.0);
    let job = GenerateJob {
        checkpoint: dir.clone(),
        pretrained: true,
        partition: partition(&layers[..ring_layers], nodes).unwrap(),
        context,
        vocab: model.config.vocab,
        prompt: prompt.clone(),
        tokens: 40,
        temperature: 1.0,
        top_k: 40,
        top_p: 0.9,
        seed: 3,
        stop: vec![stop],
        print_prompt: false,
        threads: 1,
        recv_timeout_secs: 30.0,
        tokenizer: None,
        weights_dtype: Default::default(),
        activations: None,
        tail,
    };
    job.validate(nodes as u32).unwrap();
    let backend = Backend::sim(test_seed(61));
    let ran = run_nodes(&backend, ring(nodes as u32), None, |rank, net| {
        let out = match run(&job, rank, net, &mut |_| Ok(())) {
            Ok(out) => {
                net.close().map_err(|e| e.to_string())?;
                out
            }
            Err(e) => {
                net.abort(&e.to_string());
                return Err(e.to_string());
            }
        };
        Ok::<_, String>(out.map(|(g, _)| (g.tokens, g.stopped_at)))
    });
    let rank0 = ran.results.into_iter().next().unwrap().unwrap().unwrap();
    assert_eq!(rank0, (one.tokens, Some(stop)), "{name}");
}
