//! [`DeviceMesh`]: the ranks of a group as an n-dimensional grid with named dimensions
//! (`(2, 4)` named `("dp", "tp")`), with one sub-group per slice along each dimension,
//! made once and found by name in O(1).

use std::collections::HashMap;

use super::ProcessGroup;
use crate::error::{Error, Result};

/// A grid of ranks.
///
/// # Example
///
/// Four ranks laid out 2 × 2 (`dp` rows, `tp` columns): each rank's `tp` group is its
/// row, its `dp` group its column.
///
/// ```
/// use ferroccl::pg::{DeviceMesh, PgOptions, ProcessGroup};
/// use ferroccl::{Communicator, ReduceOp};
///
/// let comms = Communicator::init_all(4)?;
/// std::thread::scope(|s| {
///     for comm in comms {
///         s.spawn(move || {
///             let rank = comm.rank();
///             let pg = ProcessGroup::from_communicator(comm, "default", PgOptions::default())
///                 .unwrap();
///             let mesh = DeviceMesh::new(&pg, &[2, 2], &["dp", "tp"]).unwrap();
///             assert_eq!(mesh.my_coordinates(), vec![rank / 2, rank % 2]);
///             // Sum over this rank's row: ranks 2·row and 2·row + 1.
///             let row = mesh.get_group("tp").unwrap();
///             let sum = row.all_reduce(vec![rank as i32], ReduceOp::Sum).unwrap().wait().unwrap();
///             assert_eq!(sum, vec![(4 * (rank / 2) + 1) as i32]);
///         });
///     }
/// });
/// # Ok::<(), ferroccl::Error>(())
/// ```
pub struct DeviceMesh {
    shape: Vec<usize>,
    names: Vec<String>,
    /// The group of this rank's slice along each dimension.
    groups: Vec<ProcessGroup>,
    by_name: HashMap<String, usize>,
    rank: usize,
}

impl std::fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMesh")
            .field("shape", &self.shape)
            .field("names", &self.names)
            .field("rank", &self.rank)
            .finish()
    }
}

impl DeviceMesh {
    /// Lays `pg`'s ranks out row-major in `shape` and makes the sub-groups (collective
    /// over `pg`).
    pub fn new(pg: &ProcessGroup, shape: &[usize], names: &[&str]) -> Result<Self> {
        let size: usize = shape.iter().product();
        if shape.is_empty() || size != pg.size() || shape.contains(&0) {
            return Err(Error::invalid(format!(
                "mesh {shape:?} holds {size} ranks; the group has {}",
                pg.size()
            )));
        }
        if names.len() != shape.len() {
            return Err(Error::invalid(format!(
                "mesh {shape:?} has {} dimensions but {} names",
                shape.len(),
                names.len()
            )));
        }
        let mut by_name = HashMap::new();
        for (i, n) in names.iter().enumerate() {
            if by_name.insert(n.to_string(), i).is_some() {
                return Err(Error::invalid(format!(
                    "mesh dimension name {n:?} used twice"
                )));
            }
        }
        let mut mesh = DeviceMesh {
            shape: shape.to_vec(),
            names: names.iter().map(|s| s.to_string()).collect(),
            groups: Vec::new(),
            by_name,
            rank: pg.rank(),
        };
        let me = mesh.coordinates(pg.rank());
        for dim in 0..shape.len() {
            // The slice: every coordinate but `dim` fixed; its color is their linear index.
            let color = (0..shape.len())
                .filter(|&d| d != dim)
                .fold(0usize, |acc, d| acc * shape[d] + me[d]);
            let g = pg
                .split(Some(color as u32), me[dim] as i32)?
                .expect("every rank has a color");
            mesh.groups.push(g);
        }
        Ok(mesh)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dimension names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The coordinates of `rank` (row-major).
    pub fn coordinates(&self, rank: usize) -> Vec<usize> {
        let mut c = vec![0; self.shape.len()];
        let mut rest = rank;
        for d in (0..self.shape.len()).rev() {
            c[d] = rest % self.shape[d];
            rest /= self.shape[d];
        }
        c
    }

    /// The rank at `coords`.
    pub fn rank_at(&self, coords: &[usize]) -> Result<usize> {
        if coords.len() != self.shape.len() || coords.iter().zip(&self.shape).any(|(c, s)| c >= s) {
            return Err(Error::invalid(format!(
                "coordinates {coords:?} are outside mesh {:?}",
                self.shape
            )));
        }
        Ok(coords
            .iter()
            .zip(&self.shape)
            .fold(0, |acc, (c, s)| acc * s + c))
    }

    /// This rank's coordinates.
    pub fn my_coordinates(&self) -> Vec<usize> {
        self.coordinates(self.rank)
    }

    /// The group of this rank's slice along dimension `name` (O(1)).
    pub fn get_group(&self, name: &str) -> Result<&ProcessGroup> {
        self.by_name
            .get(name)
            .map(|&d| &self.groups[d])
            .ok_or_else(|| {
                Error::invalid(format!(
                    "mesh has no dimension {name:?} (it has {:?})",
                    self.names
                ))
            })
    }
}
