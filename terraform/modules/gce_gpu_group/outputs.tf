output "instance_group" {
  description = "The regional managed instance group (a load balancer backend)."
  value       = google_compute_region_instance_group_manager.ferry.instance_group
}

output "model_repository_uri" {
  description = "Where to upload the Triton model repository; instances poll it for new versions."
  value       = "gs://${google_storage_bucket.models.name}/${var.model_prefix}"
}

output "service_account" {
  description = "Service account the instances run as."
  value       = google_service_account.vm.email
}
