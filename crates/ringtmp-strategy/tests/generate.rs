//! Generation over a ring against one process: a GPT trained and checkpointed by `local`, then
//! generated from with its layers split over 2 and 3 nodes (on loopback links and on the
//! simulated network), draws exactly the tokens the whole model draws in one process for the
//! same prompt and seed — greedy and sampled, through refills of the context.

use ringtmp_model::generate::{LocalChain, Sampling, generate};
use ringtmp_model::{Stage, checkpoint};
use ringtmp_strategy::TrainConfig;
use ringtmp_strategy::generate::{GenerateJob, model_layers, partition, run};
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
                partition: partition(&layers, nodes).unwrap(),
                context,
                vocab: data.classes,
                prompt: prompt.clone(),
                tokens: 30,
                temperature,
                top_k,
                seed: 11,
                threads: 1,
                recv_timeout_secs: 30.0,
                tokenizer: None,
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
