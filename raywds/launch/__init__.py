"""Start training: in this process or as a torchrun rank (`local`), or on a Ray cluster
(`ray_train`). The only part of raywds that imports ray."""
