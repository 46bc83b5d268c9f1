//! The peers, timed by python itself where `python3` has them: PyTorch's two paths, and the
//! fast safetensors loaders InstantTensor and fastsafetensors (`PYTHONPATH` may point where
//! they are installed).

use std::path::{Path, PathBuf};

/// PyTorch's paths: seconds, or why not.
pub(super) fn torch(path: &Path, pinned: bool) -> Result<f64, String> {
    let script = if pinned {
        "import sys,time,torch\nfrom safetensors.torch import load_file\ntorch.cuda.init()\nt=time.perf_counter()\nd={k:v.pin_memory().to('cuda',non_blocking=True) for k,v in load_file(sys.argv[1]).items()}\ntorch.cuda.synchronize()\nprint(time.perf_counter()-t)"
    } else {
        "import sys,time,torch\nfrom safetensors.torch import load_file\ntorch.cuda.init()\nt=time.perf_counter()\nd=load_file(sys.argv[1],device='cuda:0')\ntorch.cuda.synchronize()\nprint(time.perf_counter()-t)"
    };
    let output = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(path)
        .output()
        .map_err(|e| format!("python3: {e}", e = cuda_pinned::ErrorChain(&e)))?;
    if !output.status.success() {
        return Err("python3 with torch and safetensors not usable".into());
    }
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .map_err(|_| "python3 printed no time".into())
}

/// A fast safetensors loader of the Python world, in one configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Peer {
    /// InstantTensor reading through the page cache (`backend=BackendPolicy.BUFFERED`).
    InstantTensorBuffered,
    /// InstantTensor as it comes: on a local disk, reads past the page cache (io_uring or
    /// AIO).
    InstantTensor,
    /// fastsafetensors without GPUDirect Storage, reading through the page cache
    /// (`FASTSAFETENSORS_ODIRECT=0`).
    FastsafetensorsBuffered,
    /// fastsafetensors without GPUDirect Storage, as it comes: on a local disk, reads past the
    /// page cache (the versions that have `FASTSAFETENSORS_ODIRECT`).
    Fastsafetensors,
}

impl Peer {
    /// Each peer in the configuration that suits a warm file (read through the page cache).
    pub(super) const WARM: [Peer; 2] = [Peer::InstantTensorBuffered, Peer::FastsafetensorsBuffered];
    /// Each peer as it comes, for a cold file.
    pub(super) const COLD: [Peer; 2] = [Peer::InstantTensor, Peer::Fastsafetensors];

    /// Whether it is a cold row's configuration.
    pub(super) fn cold(self) -> bool {
        Self::COLD.contains(&self)
    }

    /// The row's name.
    pub(super) fn row(self) -> String {
        use pinned_bench::goals::{
            FILES_FASTSAFETENSORS_COLD_ROW, FILES_FASTSAFETENSORS_WARM_ROW,
            FILES_INSTANTTENSOR_COLD_ROW, FILES_INSTANTTENSOR_WARM_ROW,
        };
        match self {
            Self::InstantTensorBuffered => FILES_INSTANTTENSOR_WARM_ROW,
            Self::InstantTensor => FILES_INSTANTTENSOR_COLD_ROW,
            Self::FastsafetensorsBuffered => FILES_FASTSAFETENSORS_WARM_ROW,
            Self::Fastsafetensors => FILES_FASTSAFETENSORS_COLD_ROW,
        }
        .to_owned()
    }
}

/// The loading script: loads the files `reps` times after `untimed` loads, each until every
/// tensor is on the GPU, and prints the seconds of each timed load.
const PEER_SCRIPT: &str = r#"import os,sys,time,torch
peer,untimed,reps,files=sys.argv[1],int(sys.argv[2]),int(sys.argv[3]),sys.argv[4:]
torch.cuda.init()
if peer.startswith('instanttensor'):
    from instanttensor import safe_open
    options={}
    if peer.endswith('buffered'):
        from instanttensor import BackendPolicy
        options['backend']=BackendPolicy.BUFFERED
    # Tensors that own their memory (views into its ring, where `copy` is not asked, are
    # reused while it reads on); a list of files in one call, else a file at a time.
    def load():
        try:
            with safe_open(files if len(files)>1 else files[0],framework='pt',device=0,copy=True,**options) as f:
                d=dict(f.tensors())
        except (TypeError,IndexError):
            d={}
            for name in files:
                with safe_open(name,framework='pt',device=0,copy=True,**options) as f:
                    d.update(f.tensors())
        torch.cuda.synchronize()
        return d
else:
    from fastsafetensors import fastsafe_open
    # Its tensors are valid while its file buffer is open: waited for inside.
    def load():
        with fastsafe_open(filenames=files,framework='pt',device='cuda:0',nogds=True) as f:
            d={k:f.get_tensor(k) for k in f.keys()}
            torch.cuda.synchronize()
            return d
for i in range(untimed+reps):
    t=time.perf_counter()
    d=load()
    s=time.perf_counter()-t
    del d
    torch.cuda.empty_cache()
    # As for pinned-io: the driver goes on releasing freed memory for a while.
    time.sleep(0.25)
    if i>=untimed:
        print(s,flush=True)
"#;

/// Seconds of each of `reps` loads of `files` by `peer` after `untimed` loads, or why not.
pub(super) fn peer(
    peer: Peer,
    files: &[PathBuf],
    untimed: usize,
    reps: usize,
) -> Result<Vec<f64>, String> {
    let (name, odirect) = match peer {
        Peer::InstantTensorBuffered => ("instanttensor-buffered", None),
        Peer::InstantTensor => ("instanttensor", None),
        Peer::FastsafetensorsBuffered => ("fastsafetensors", Some("0")),
        Peer::Fastsafetensors => ("fastsafetensors", None),
    };
    let mut command = std::process::Command::new("python3");
    command
        .args(["-c", PEER_SCRIPT, name])
        .arg(untimed.to_string())
        .arg(reps.to_string())
        .args(files);
    // Newer versions let a second variable override the first.
    command.env_remove("FASTSAFETENSORS_NOGDS_ODIRECT");
    match odirect {
        Some(value) => command.env("FASTSAFETENSORS_ODIRECT", value),
        None => command.env_remove("FASTSAFETENSORS_ODIRECT"),
    };
    let output = command
        .output()
        .map_err(|e| format!("python3: {e}", e = cuda_pinned::ErrorChain(&e)))?;
    if !output.status.success() {
        let error = String::from_utf8_lossy(&output.stderr);
        let last = error.lines().last().unwrap_or("no output");
        return Err(format!("not usable here: {last}"));
    }
    let seconds: Vec<f64> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect();
    if seconds.len() == reps {
        Ok(seconds)
    } else {
        Err("python3 printed no time".into())
    }
}
