"""The running process's plumbing: the tick loop (daemon.py) and the service around it (service.py),
the one sampler (sampler.py), the recording run of `kvwatt baseline record` (recorder.py), the state
directory and crash-safe writes (statedir.py, atomic.py), logging (logsetup.py, logfilter.py), when
the garbage collector walks what (gcpolicy.py), progress lines (progress.py) and what this kvwatt is (build.py)."""
