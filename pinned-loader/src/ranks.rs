//! This process's place among the processes of a distributed job, as its launcher told it:
//! torchrun, an MPI launcher or Slurm set variables in each process's environment.

use std::fmt;

/// The launcher whose variables gave a process its rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// torchrun (or `torch.distributed.launch`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`.
    Torchrun,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`.
    OpenMpi,
    /// MPICH and Intel MPI (the PMI interface): `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`.
    Pmi,
    /// Slurm's `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
    Slurm,
}

/// Each launcher's variables: rank, world size, rank on the node.
const VARIABLES: [(Launcher, [&str; 3]); 4] = [
    (Launcher::Torchrun, ["RANK", "WORLD_SIZE", "LOCAL_RANK"]),
    (
        Launcher::OpenMpi,
        [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ],
    ),
    (Launcher::Pmi, ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"]),
    (
        Launcher::Slurm,
        ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
    ),
];

/// A process's rank among `world_size` processes, and its rank on its node where the
/// launcher says it (the GPU it usually takes).
///
/// torchrun starts the processes it ranks, so where its variables are set they are the
/// process's, whatever launched torchrun itself (`srun torchrun …` ranks nodes in Slurm's and
/// workers in torchrun's). Without them, the MPI launchers' and Slurm's ranks must agree where
/// several are set (`srun` starting MPI processes sets both): a disagreement is an error
/// rather than a guess.
///
/// # Examples
///
/// ```
/// use pinned_loader::{Launcher, LoaderConfig, Ranks};
///
/// let env = |name: &str| match name {
///     "RANK" => Some("3".to_owned()),
///     "WORLD_SIZE" => Some("8".to_owned()),
///     "LOCAL_RANK" => Some("1".to_owned()),
///     _ => None,
/// };
/// let ranks = Ranks::from_vars(env)?.expect("launched by torchrun");
/// assert_eq!((ranks.rank, ranks.world_size, ranks.local_rank), (3, 8, Some(1)));
/// assert_eq!(ranks.launcher, Launcher::Torchrun);
/// // This process's share of the samples:
/// let config = LoaderConfig::new(64).shard(ranks.rank, ranks.world_size);
/// # let _ = config;
/// # Ok::<(), pinned_loader::RanksError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ranks {
    /// This process's rank, from 0.
    pub rank: usize,
    /// The processes of the job.
    pub world_size: usize,
    /// This process's rank on its node, where the launcher sets it.
    pub local_rank: Option<usize>,
    /// Whose variables these are.
    pub launcher: Launcher,
}

impl Ranks {
    /// This process's ranks from its environment; `None` where no launcher set them (a
    /// process on its own).
    ///
    /// # Errors
    ///
    /// As [`from_vars`](Self::from_vars).
    pub fn from_env() -> Result<Option<Self>, RanksError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The ranks that the variables `var` gives (`var(name)` is the variable's value, if set).
    ///
    /// # Errors
    ///
    /// [`RanksError`] where a launcher's rank or size is set without the other, a value is not
    /// a number, a rank is not below its size, or two launchers (MPI's, Slurm's) disagree.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, RanksError> {
        let mut found: Vec<Self> = Vec::new();
        for (launcher, [rank, size, local]) in VARIABLES {
            let number = |name: &'static str| -> Result<Option<usize>, RanksError> {
                let Some(value) = var(name) else {
                    return Ok(None);
                };
                match value.trim().parse() {
                    Ok(number) => Ok(Some(number)),
                    Err(_) => Err(RanksError::NotANumber { name, value }),
                }
            };
            let ranks = match (number(rank)?, number(size)?) {
                (None, None) => continue,
                (Some(_), None) => {
                    return Err(RanksError::Missing {
                        set: rank,
                        missing: size,
                    });
                }
                (None, Some(_)) => {
                    return Err(RanksError::Missing {
                        set: size,
                        missing: rank,
                    });
                }
                (Some(rank), Some(world_size)) => Self {
                    rank,
                    world_size,
                    local_rank: number(local)?,
                    launcher,
                },
            };
            if ranks.rank >= ranks.world_size {
                return Err(RanksError::OutOfRange {
                    launcher,
                    rank: ranks.rank,
                    world_size: ranks.world_size,
                });
            }
            if launcher == Launcher::Torchrun {
                return Ok(Some(ranks));
            }
            if let Some(first) = found.first()
                && (first.rank, first.world_size) != (ranks.rank, ranks.world_size)
            {
                return Err(RanksError::Disagree {
                    first: *first,
                    second: ranks,
                });
            }
            found.push(ranks);
        }
        Ok(found.first().copied())
    }
}

/// Why a launcher's variables give no ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RanksError {
    /// A rank without its world size, or the other way round.
    Missing {
        /// The variable set.
        set: &'static str,
        /// The variable that is not.
        missing: &'static str,
    },
    /// A value that is not a number.
    NotANumber {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// A rank not below its world size.
    OutOfRange {
        /// Whose variables.
        launcher: Launcher,
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// Two launchers that give different ranks.
    Disagree {
        /// The ranks of one.
        first: Ranks,
        /// The other's.
        second: Ranks,
    },
}

impl fmt::Display for RanksError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { set, missing } => {
                write!(f, "{set} is set but {missing} is not: no world to rank in")
            }
            Self::NotANumber { name, value } => write!(f, "{name}={value:?} is not a number"),
            Self::OutOfRange {
                launcher,
                rank,
                world_size,
            } => write!(
                f,
                "{launcher:?} gives rank {rank} of a world of {world_size}: ranks go from 0 to \
                 the size less one"
            ),
            Self::Disagree { first, second } => write!(
                f,
                "{:?} gives rank {} of {}, but {:?} rank {} of {}: which launcher started this \
                 process?",
                first.launcher,
                first.rank,
                first.world_size,
                second.launcher,
                second.rank,
                second.world_size
            ),
        }
    }
}

impl std::error::Error for RanksError {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = (pairs.iter())
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn each_launcher_is_read_and_none_is_none() {
        assert_eq!(Ranks::from_vars(env(&[])), Ok(None));
        let cases = [
            (
                Launcher::OpenMpi,
                [("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4")],
            ),
            (Launcher::Pmi, [("PMI_RANK", "2"), ("PMI_SIZE", "4")]),
            (
                Launcher::Slurm,
                [("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4")],
            ),
        ];
        for (launcher, pairs) in cases {
            let ranks = Ranks::from_vars(env(&pairs)).unwrap().unwrap();
            assert_eq!(
                (ranks.rank, ranks.world_size, ranks.launcher),
                (2, 4, launcher)
            );
            assert_eq!(ranks.local_rank, None);
        }
    }

    #[test]
    fn torchrun_ranks_its_workers_under_any_launcher() {
        // `srun torchrun`: Slurm ranks the nodes, torchrun the workers on them.
        let vars = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("RANK", "5"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "5"),
        ]);
        let ranks = Ranks::from_vars(vars).unwrap().unwrap();
        assert_eq!((ranks.rank, ranks.world_size), (5, 16));
        assert_eq!(
            (ranks.local_rank, ranks.launcher),
            (Some(5), Launcher::Torchrun)
        );
    }

    #[test]
    fn what_cannot_be_a_rank_is_refused_by_name() {
        let refused =
            |pairs: &[(&str, &str)]| Ranks::from_vars(env(pairs)).unwrap_err().to_string();
        assert_eq!(
            refused(&[("RANK", "0")]),
            "RANK is set but WORLD_SIZE is not: no world to rank in"
        );
        assert_eq!(
            refused(&[("RANK", "x"), ("WORLD_SIZE", "2")]),
            "RANK=\"x\" is not a number"
        );
        assert!(
            refused(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")]).contains("rank 4 of a world of 4")
        );
        let disagree = refused(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
        ]);
        assert!(
            disagree.contains("OpenMpi gives rank 1 of 4, but Slurm rank 2 of 4"),
            "{disagree}"
        );
    }

    proptest! {
        #[test]
        fn launchers_that_agree_give_their_ranks(
            world in 1usize..1000,
            rank in 0usize..1000,
            local in proptest::option::of(0usize..8),
            slurm_too in any::<bool>(),
        ) {
            let rank = rank % world;
            let (rank_text, world_text) = (rank.to_string(), world.to_string());
            let local_text = local.map(|l| l.to_string());
            let mut pairs = vec![
                ("OMPI_COMM_WORLD_RANK", rank_text.as_str()),
                ("OMPI_COMM_WORLD_SIZE", world_text.as_str()),
            ];
            if let Some(local) = &local_text {
                pairs.push(("OMPI_COMM_WORLD_LOCAL_RANK", local.as_str()));
            }
            if slurm_too {
                pairs.push(("SLURM_PROCID", rank_text.as_str()));
                pairs.push(("SLURM_NTASKS", world_text.as_str()));
            }
            let ranks = Ranks::from_vars(env(&pairs)).unwrap().unwrap();
            prop_assert_eq!((ranks.rank, ranks.world_size, ranks.local_rank), (rank, world, local));
            prop_assert_eq!(ranks.launcher, Launcher::OpenMpi);
        }
    }
}
