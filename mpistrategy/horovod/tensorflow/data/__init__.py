"""Not provided: Horovod's tf.data service (`horovod.tensorflow.data`).

Horovod's `compute_service` (`TfDataServiceConfig`, `send_to_data_service`,
`tf_data_service`) runs tf.data service dispatchers and workers beside the
training ranks.  Importing this module, or any module under it, raises
`NotImplementedError` saying what to use instead, so a migrated script
fails at its import line rather than with a bare `ModuleNotFoundError`.
"""

raise NotImplementedError(
    "horovod.tensorflow.data (Horovod's tf.data service: compute_service, "
    "TfDataServiceConfig, send_to_data_service) is not provided by "
    "mpistrategy.horovod; build the input pipeline in every rank with "
    "tf.data and give each rank its share (dataset.shard(hvd.size(), "
    "hvd.rank()))")
