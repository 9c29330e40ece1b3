//! What a gpu-ckpt checkpoint is: archive layout, manifest, OCI image, compatibility.
