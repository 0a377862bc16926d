"""What `flaxchat.remote` and `flaxchat.cloud` share, so neither imports the other: the runner
interface (`base`: RemoteRunner, RunResult, RunStatus, the errors) and the standard-library job
supervisor (`worker`, run by path on a TPU worker, a Kaggle kernel or this machine)."""
