"""fastlm's commands: `fastlm-train` (`python -m fastlm.cli.train`) trains a model and writes
checkpoints, `fastlm-generate` (`python -m fastlm.cli.generate`) samples from one. From Python,
sampling is `fastlm.sample`; the commands build on `fastlm.config`, `fastlm.data` and
`fastlm.checkpoint`."""
