//! Table tests of the failure protocols' pure cores, read from `tests/data/<protocol>/*.txt` in
//! the datadriven format raft-rs uses: a directive with arguments, `----`, and what the machine
//! or policy did, one action a line (`ok` for none).
//! - `regroup/`: the all-reduce's re-formation (`collective::regroup`). Each file is one machine's
//!   life: `lead …` or `follow …` starts it, the lines after feed it events.
//! - `heal/`: the ring's heal around a dead node (`ring::heal::policy`): the master's decision
//!   and each survivor's restore.
//! - `pairing/`: one AD-PSGD worker's side of the pairwise averaging (`gossip::pairing`). Each
//!   file starts a worker with `worker rank=R workers=N allowed=A`, then feeds it events.
//!
//! `REWRITE=1 cargo test --test protocols` rewrites the expected outputs (then read the diff).

use std::collections::HashMap;

use ringtmp_strategy::collective::regroup::{Follow, FollowAction, Lead, LeadAction, Order};
use ringtmp_strategy::gossip::pairing::{PairAction, Pairing};
use ringtmp_strategy::ring::heal::policy;

fn num(args: &HashMap<String, Vec<String>>, key: &str) -> u64 {
    args.get(key)
        .and_then(|v| v.first())
        .unwrap_or_else(|| panic!("argument {key} missing"))
        .parse()
        .unwrap_or_else(|e| panic!("argument {key}: {e}"))
}

fn ranks(args: &HashMap<String, Vec<String>>, key: &str) -> Vec<u32> {
    args.get(key)
        .unwrap_or_else(|| panic!("argument {key} missing"))
        .iter()
        .map(|r| r.parse().expect("a rank"))
        .collect()
}

fn text(args: &HashMap<String, Vec<String>>, key: &str) -> String {
    args.get(key).map(|v| v.join(",")).unwrap_or_default()
}

fn order(o: &Order) -> String {
    format!(
        "generation={} members={:?} step={} steps={}",
        o.generation, o.members, o.step, o.optimizer_steps
    )
}

fn show_lead(actions: Vec<LeadAction>) -> String {
    let lines: Vec<String> = actions
        .into_iter()
        .map(|a| match a {
            LeadAction::Notice(t) => format!("notice: {t}"),
            LeadAction::Dropped { rank, step, reason } => {
                format!("dropped rank={rank} step={step} reason={reason}")
            }
            LeadAction::SendOrder { to, order: o } => format!("send-order to={to} {}", order(&o)),
            LeadAction::SendState { to, generation } => {
                format!("send-state to={to} generation={generation}")
            }
            LeadAction::Await(r) => format!("await {r}"),
            LeadAction::Done => "done".into(),
            LeadAction::Fail(why) => format!("fail: {why}"),
        })
        .collect();
    if lines.is_empty() {
        "ok\n".into()
    } else {
        lines.join("\n") + "\n"
    }
}

fn show_follow(actions: Vec<FollowAction>) -> String {
    let lines: Vec<String> = actions
        .into_iter()
        .map(|a| match a {
            FollowAction::AwaitOrder => "await-order".into(),
            FollowAction::SendHolding { generation, steps } => {
                format!("send-holding generation={generation} steps={steps}")
            }
            FollowAction::AwaitState => "await-state".into(),
            FollowAction::LoadState { optimizer_steps } => {
                format!("load-state steps={optimizer_steps}")
            }
            FollowAction::Finish(o) => format!("finish {}", order(&o)),
            FollowAction::Fail(why) => format!("fail: {why}"),
        })
        .collect();
    if lines.is_empty() {
        "ok\n".into()
    } else {
        lines.join("\n") + "\n"
    }
}

#[test]
fn regroup_tables() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/regroup");
    let mut cases = 0;
    datadriven::walk(dir, |file| {
        let mut lead: Option<Lead> = None;
        let mut follow: Option<Follow> = None;
        file.run(|case| -> String {
            cases += 1;
            let a = &case.args;
            match case.directive.as_str() {
                "lead" => {
                    let (machine, actions) = Lead::start(
                        &ranks(a, "members"),
                        num(a, "generation"),
                        num(a, "dead") as u32,
                        text(a, "reason"),
                        num(a, "step"),
                        num(a, "steps"),
                    );
                    lead = Some(machine);
                    show_lead(actions)
                }
                "follow" => {
                    follow = Some(Follow::new(
                        num(a, "rank") as u32,
                        num(a, "generation"),
                        num(a, "steps"),
                    ));
                    "ok\n".into()
                }
                "idle" => match (&mut lead, &follow) {
                    (Some(l), _) => show_lead(l.handle_idle()),
                    (None, Some(f)) => show_follow(f.handle_idle()),
                    _ => panic!("no machine"),
                },
                "lost" => show_lead(
                    lead.as_mut()
                        .expect("lead")
                        .handle_lost(num(a, "rank") as u32, text(a, "reason")),
                ),
                "holding" => show_lead(lead.as_mut().expect("lead").handle_holding(
                    num(a, "from") as u32,
                    num(a, "generation"),
                    num(a, "steps"),
                )),
                "ring" => {
                    let l = lead.as_ref().expect("lead");
                    format!("members={:?} generation={}\n", l.members(), l.generation())
                }
                "order" => show_follow(follow.as_mut().expect("follow").handle_order(Order {
                    generation: num(a, "generation"),
                    members: ranks(a, "members"),
                    step: num(a, "step"),
                    optimizer_steps: num(a, "steps"),
                })),
                "chunk" => format!(
                    "{:?}\n",
                    follow
                        .as_ref()
                        .expect("follow")
                        .handle_chunk(num(a, "generation"))
                ),
                "state" => show_follow(follow.as_mut().expect("follow").handle_state(
                    num(a, "generation"),
                    num(a, "values"),
                    num(a, "expected"),
                )),
                other => panic!("unknown directive {other}"),
            }
        })
    });
    assert!(cases > 20, "only {cases} cases read from {dir}");
}

#[test]
fn heal_tables() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/heal");
    let mut cases = 0;
    datadriven::walk(dir, |file| {
        file.run(|case| -> String {
            cases += 1;
            let a = &case.args;
            match case.directive.as_str() {
                "decide" => {
                    let round = a.get("round").map(|_| num(a, "round"));
                    match policy::decide(
                        &ranks(a, "members"),
                        num(a, "dead") as u32,
                        round,
                        num(a, "last"),
                    ) {
                        Ok(heal) => format!("{heal}\n"),
                        Err(why) => format!("refuse: {why}\n"),
                    }
                }
                "restore" => {
                    let (before, after) = (ranks(a, "before"), ranks(a, "after"));
                    format!(
                        "{:?} departed={:?}\n",
                        policy::restore(num(a, "rank") as u32, &before, &after),
                        policy::departed(&before, &after)
                    )
                }
                other => panic!("unknown directive {other}"),
            }
        })
    });
    assert!(cases >= 8, "only {cases} cases read from {dir}");
}

fn show_pairing(actions: Vec<PairAction>, worker: &Pairing) -> String {
    let mut lines: Vec<String> = actions
        .into_iter()
        .map(|a| match a {
            PairAction::Request { to, iteration } => {
                format!("request to={to} iteration={iteration}")
            }
            PairAction::Answer { to } => format!("answer to={to} then average"),
            PairAction::Average => "average".into(),
            PairAction::Finished { to } => format!("finished to={to}"),
            PairAction::Left { rank } => format!("left rank={rank}"),
            PairAction::Fail(why) => format!("fail: {why}"),
        })
        .collect();
    if lines.is_empty() {
        lines.push("ok".into());
    }
    if let Some(rank) = worker.awaiting() {
        lines.push(format!("(awaiting {rank})"));
    }
    lines.join("\n") + "\n"
}

#[test]
fn pairing_tables() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/pairing");
    let mut cases = 0;
    datadriven::walk(dir, |file| {
        let mut worker: Option<Pairing> = None;
        file.run(|case| -> String {
            cases += 1;
            let a = &case.args;
            if case.directive == "worker" {
                let w = Pairing::new(
                    num(a, "rank") as u32,
                    num(a, "workers") as u32,
                    num(a, "allowed"),
                );
                let Some(w) = w else {
                    return "refused: the graph is not bipartite\n".into();
                };
                let line = format!(
                    "{} near={:?}\n",
                    if w.active() { "active" } else { "passive" },
                    w.near()
                );
                worker = Some(w);
                return line;
            }
            let w = worker.as_mut().expect("a worker directive first");
            let actions = match case.directive.as_str() {
                "iteration" => {
                    let pick = num(a, "pick") as usize;
                    w.handle_iteration(num(a, "n"), |_| pick)
                }
                "model" => w.handle_model(num(a, "from") as u32, num(a, "iteration")),
                "allow" => w.handle_allow(num(a, "from") as u32, num(a, "iterations")),
                "stop" => w.handle_stop(num(a, "from") as u32),
                "finished" => w.handle_finished(num(a, "from") as u32),
                "lost" => w.handle_lost(num(a, "rank") as u32, &text(a, "reason")),
                "end" => w.handle_end(),
                "state" => {
                    let done = num(a, "done");
                    return format!(
                        "may-iterate={} released={} stopped={}\n",
                        w.may_iterate(done),
                        w.released(),
                        w.stopped()
                    );
                }
                "gone" => {
                    return format!("{}\n", w.is_gone(num(a, "rank") as u32));
                }
                other => panic!("unknown directive {other}"),
            };
            show_pairing(actions, w)
        })
    });
    assert!(cases >= 20, "only {cases} cases read from {dir}");
}
