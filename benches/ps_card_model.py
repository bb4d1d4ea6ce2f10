#!/usr/bin/env python3
"""Why the simulator's fair card runs the cnn's DSSP parameter server at 0.82× its real speed
(docs/decisions/simulation.md, docs/benchmarks/logs/log-09.md): the server's card alone, as a queue.

Three workers; each pulls the parameters from the server (0.187 s on the server's card when
alone), computes (0.022 s, ±5%), pushes its gradient on its own card (0.187 s) and pulls again;
2 ms latency each way. The server's card serves the pulls first come first served or as a fluid
fair share. Prints the card's busy fraction and the pulls per second of each:

    python3 benches/ps_card_model.py      # fifo ≈ 0.998 busy, fair ≈ 0.81
"""
import random

S, P, C, L = 0.187, 0.187, 0.022, 0.002


def run(fair, jitter=0.05, rounds=600, seed=1):
    """Returns (the card's busy fraction, pulls per second) over `rounds` pulls."""
    rnd = random.Random(seed)

    def compute():
        return C * (1 + jitter * (2 * rnd.random() - 1))

    t, busy, done = 0.0, 0.0, 0
    # When each worker's push (and so its next pull) reaches the server.
    arrivals = [compute() + P + L for _ in range(3)]
    queue = []  # pulls on the card: [worker, seconds of card time left when alone]
    while done < rounds:
        next_arrival = min(arrivals)
        if queue:
            # Time until the next pull leaves the card at the current sharing.
            first = min(q[1] for q in queue) * len(queue) if fair else queue[0][1]
        else:
            first = float("inf")
        dt = min(first, next_arrival - t)
        if queue:
            busy += dt
            if fair:
                for q in queue:
                    q[1] -= dt / len(queue)
            else:
                queue[0][1] -= dt
        t += dt
        if first <= next_arrival - t + dt:
            for q in [q for q in queue if q[1] <= 1e-12]:
                done += 1
                arrivals[q[0]] = t + L + compute() + P + L
            queue = [q for q in queue if q[1] > 1e-12]
        else:
            w = arrivals.index(next_arrival)
            arrivals[w] = float("inf")
            queue.append([w, S])
    return busy / t, done / t


if __name__ == "__main__":
    for name, fair, jitter in [("fifo", False, 0.05), ("fair", True, 0.05), ("fair, no jitter", True, 0.0)]:
        busy, pulls = run(fair, jitter)
        print(f"{name:<16} card busy {busy:.3f}, {pulls:.2f} pulls/s")
