"""The Avro contract of SparSEEty: one ``.avsc`` file per record, namespace ``io.sparseety.v1``.

This folder is data; it is a package only so that the ``.avsc`` files install with the
distribution (``importlib.resources.files("sparseety.schemas")``).
"""
