//! Bringing a node up: placement → peer listener → rendezvous → links along the topology.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ringtmp_transport::{Network, TransportConfig, TransportError, bind_listener};

use crate::launch::Placement;
use crate::rendezvous::{self, Offer, Table};

/// How a node joins its run.
#[derive(Clone, Debug)]
pub struct JoinOptions {
    /// Host (or IP) this node listens on for peers; port chosen by the system.
    pub listen_host: String,
    /// Shared secret.
    pub secret: Vec<u8>,
    /// Longest wait for rendezvous and for links.
    pub connect_timeout: Duration,
    /// Transport settings other than identity (heartbeats, timeouts, shaping, limits).
    pub transport: TransportConfig,
}

/// Joins the run: rendezvous (rank 0 serves its `offer`, asking the others first when it has a
/// request, which they answer with `answer`; the others receive rank 0's settings), then links
/// to `neighbours(rank, world_size, settings)` — the topology may depend on the job. Returns the table (with the settings every node must use)
/// and the network.
pub fn join(
    placement: &Placement,
    options: &JoinOptions,
    offer: Offer,
    answer: &dyn Fn(&str) -> String,
    neighbours: impl Fn(u32, u32, &str) -> BTreeSet<u32>,
) -> Result<(Table, Network), TransportError> {
    let listener = bind_listener(&format!("{}:0", options.listen_host))?;
    let own = listener.local_addr().map_err(|e| TransportError::Io {
        context: "peer listener".into(),
        source: e,
    })?;
    let master = format!("{}:{}", placement.master_addr, placement.master_port);
    let table = if placement.rank == 0 {
        let bind = format!("{}:{}", placement.master_addr, placement.master_port);
        // A wildcard listener is advertised at the rendezvous address where that is a concrete
        // one; otherwise every node fills in the address it reached rank 0 at.
        let own = advertised(own, &placement.master_addr);
        rendezvous::serve(
            &bind,
            placement.world_size,
            own,
            offer,
            &options.secret,
            options.connect_timeout,
        )?
    } else {
        rendezvous::join(
            &master,
            placement.rank,
            placement.world_size,
            own,
            &options.secret,
            options.connect_timeout,
            answer,
        )?
    };
    let mut addresses = BTreeMap::new();
    for node in &table.nodes {
        addresses.insert(node.rank, table.addr(node.rank)?);
    }
    let mut cfg = options.transport.clone();
    cfg.run_id = table.run_id;
    cfg.rank = placement.rank;
    cfg.secret = options.secret.clone();
    cfg.connect_timeout = options.connect_timeout;
    let network = Network::connect(
        cfg,
        listener,
        &addresses,
        &neighbours(placement.rank, placement.world_size, &table.settings),
    )?;
    Ok((table, network))
}

/// The address rank 0 advertises for its peer listener at `own`: `own` itself, or, when it
/// listens on every interface, the rendezvous host's address when that is a concrete IP.
fn advertised(own: std::net::SocketAddr, master_addr: &str) -> std::net::SocketAddr {
    match master_addr.parse::<std::net::IpAddr>() {
        Ok(ip) if own.ip().is_unspecified() && !ip.is_unspecified() => {
            std::net::SocketAddr::new(ip, own.port())
        }
        _ => own,
    }
}
