//! The protocols by which a slice of a plan crosses a FIFO.

/// How a FIFO publishes its slots, as in NCCL (the transport's FIFOs,
/// `crate::transport::fifo`, describe both), or whether a message crosses by reference
/// instead: a plan's operation carries one, and the cost model chooses it per call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Protocol {
    /// Data, byte count, then the `head` counter: full bandwidth.
    #[default]
    Simple,
    /// The flag travels with the data: low latency, for small messages (on the host, a
    /// header in the message's first cache line; on a GPU, a flag in every 8-byte line,
    /// at half the bandwidth).
    LL,
    /// Between ranks of one host, a message is a descriptor of the sender's region in
    /// a Simple slot, and the receiver reads the region itself
    /// (`crate::transport::single_copy`): one copy instead of two, for large messages.
    /// Only for plans in which every message is a region of a buffer
    /// ([`Protocol::carries`]).
    SingleCopy,
}

impl Protocol {
    /// Every protocol, in the order the cost model prefers on ties.
    pub const ALL: [Protocol; 3] = [Protocol::Simple, Protocol::LL, Protocol::SingleCopy];

    /// Its position in [`Protocol::ALL`], for tables kept per protocol.
    pub fn index(&self) -> usize {
        match self {
            Protocol::Simple => 0,
            Protocol::LL => 1,
            Protocol::SingleCopy => 2,
        }
    }

    /// The FIFOs its messages travel in: single-copy descriptors in Simple slots.
    pub fn fifo(&self) -> Protocol {
        match self {
            Protocol::LL => Protocol::LL,
            Protocol::Simple | Protocol::SingleCopy => Protocol::Simple,
        }
    }

    /// NCCL's name for it (`Simple`, `LL`), or ferroccl's (`SingleCopy`).
    pub fn name(&self) -> &'static str {
        match self {
            Protocol::Simple => "Simple",
            Protocol::LL => "LL",
            Protocol::SingleCopy => "SingleCopy",
        }
    }

    /// Whether `algorithm`'s plan of `collective` on `nranks` ranks can use this
    /// protocol. Single copy needs every message to be a region of a buffer the sender
    /// keeps (its input, its output): a ring's `recvReduceSend`, which sends a sum it
    /// never stores, cannot be read in place, so reducing rings of more than two ranks
    /// and trees keep the FIFOs. Nor can the one-shot all-reduce: in place, every rank
    /// would fold into the very buffer its peers are reading, and each would wait for
    /// the others to finish reading first; recursive doubling folds into the output its
    /// partner reads in every round. The two-shot, the other direct collectives and
    /// every moving collective qualify.
    pub fn carries(
        &self,
        collective: super::Collective,
        algorithm: super::Algorithm,
        nranks: usize,
    ) -> bool {
        use super::Algorithm;
        match self {
            Protocol::Simple | Protocol::LL => true,
            Protocol::SingleCopy => match algorithm {
                Algorithm::OneShot => collective != super::Collective::AllReduce,
                Algorithm::TwoShot => true,
                Algorithm::Tree | Algorithm::Doubling => false,
                Algorithm::Ring => !collective.is_reducing() || nranks <= 2,
            },
        }
    }
}
